"""The parts of a chat request: tools, tool calls and messages, and the chat template's view of them.

A message becomes what chat templates are given (`template_message`: content a string, tool-call
arguments a dict, reasoning under `reasoning_content`, developer as system); a field its role does not
use, a content part other than text, or a key beside a text part's two is refused with a 400 naming it.
`template_variables` adds the tools and chat_template_kwargs, which may not set what cairn sets. What this
is not: the request bodies (`openai.protocol`) or rendering the template (`cairn.tokenizer`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError

from cairn.request.prompt import CacheMark
from cairn.request.tokenizer import TEMPLATE_VARIABLES_SET_HERE
from cairn.server.chat.strict import Strict
from cairn.server.errors import APIError

# ---- tools --------------------------------------------------------------------------------------

FunctionName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\s<>]+$")]  # no markup in a name


class FunctionDef(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments
    strict: bool | None = None  # true: a call this answer makes follows the tools' schemas (constrained)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


def refuse_duplicate_names(names: list[str], param: str | list[str]) -> None:
    """A 400 naming the second of two tools that share a name (`param`: the path of a tool's name, `{}`
    standing for its index, or each name's path): a call names its function, so which of the two it meant
    would be a guess."""
    seen: set[str] = set()
    for j, name in enumerate(names):
        if name in seen:
            raise APIError(400, f"two tools are named {name!r}: tool names must be unique", code="invalid_value",
                           param=param[j] if isinstance(param, list) else param.format(j))
        seen.add(name)


def _unique_function_names(tools: list[Tool]) -> list[Tool]:
    refuse_duplicate_names([t.function.name for t in tools], "tools.{}.function.name")
    return tools


Tools = Annotated[list[Tool], AfterValidator(_unique_function_names)]


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(Strict):
    name: FunctionName
    arguments: str | dict[str, Any]  # a JSON object as a string (OpenAI) or already parsed


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# ---- messages -----------------------------------------------------------------------------------

class ChatMessage(Strict):
    """One message. Keys the openai client echoes back from a response (refusal, annotations, audio,
    function_call) are accepted when null."""

    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: its thinking (vLLM's name)
    reasoning: str | None = None  # the same, under vLLM's newer name
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None


def template_message(index: int, m: ChatMessage) -> dict[str, Any]:
    """The message as chat templates want it: content a string, tool-call arguments a dict (as
    transformers' apply_chat_template is given them), reasoning under `reasoning_content`, a developer
    message as the system message it stands for (OpenAI's clients send instructions under that role; chat
    templates know only system)."""
    _check_role_fields(index, m)
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": text_content(index, m.content)}
    if m.name is not None:
        out["name"] = m.name
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [_template_tool_call(index, j, c) for j, c in enumerate(m.tool_calls)]
    return out


def _check_role_fields(index: int, m: ChatMessage) -> None:
    """Refuse, with a 400 naming it, a field that the message's role does not use (chat templates read
    tool_calls and the reasoning only on an assistant message, tool_call_id only on a tool result: they
    would drop it), and the reasoning sent under both its names (one would be dropped)."""
    only_on = (("tool_calls", m.tool_calls, "assistant"), ("tool_call_id", m.tool_call_id, "tool"),
               ("reasoning_content", m.reasoning_content, "assistant"), ("reasoning", m.reasoning, "assistant"))
    for name, value, role in only_on:
        if value is not None and m.role != role:
            raise APIError(400, f"{name} is only read on a message of role {role!r}, not {m.role!r}",
                           param=f"messages.{index}.{name}", code="invalid_value")
    if m.reasoning_content is not None and m.reasoning is not None:
        raise APIError(400, "send the reasoning once, as reasoning_content or as reasoning (two names for it)",
                       param=f"messages.{index}.reasoning", code="invalid_value")


def _template_tool_call(index: int, j: int, c: ToolCall) -> dict[str, Any]:
    args = c.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            raise APIError(400, "tool call arguments must be a JSON object",
                           param=f"messages.{index}.tool_calls.{j}.function.arguments", code="invalid_value")
    call = {"type": "function", "function": {"name": c.function.name, "arguments": args}}
    if c.id is not None:
        call["id"] = c.id
    return call


TTL_SECONDS = {"5m": 300, "1h": 3600}  # the `ttl` values of a cache_control mark; 5m when left out


class CacheControl(Strict):
    """A cache breakpoint: the prefix up to the end of the block it is on is to be cached (for `ttl`)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def ttl_s(self) -> int:
        return TTL_SECONDS[self.ttl or "5m"]


def part_cache_marks(messages) -> list[CacheMark]:
    """The cache breakpoints on chat messages' text parts (`cache_control`, as Anthropic's blocks take it, which
    some clients send on the chat route too): each ends where its part's text ends in the message's content
    (`text_content` joins the parts with newlines)."""
    marks = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str) or m.content is None:
            continue
        end = -1
        for j, part in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            end += 1 + len(_part_text(where, part))
            if part.get("cache_control") is not None:
                marks.append(CacheMark(_cache_control(where, part["cache_control"]).ttl_s, where, message=i,
                                       content_end=end))
    return marks


def _cache_control(where: str, value: Any) -> CacheControl:
    try:
        return CacheControl.model_validate(value)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        field = ".".join(str(k) for k in error["loc"])
        param = f"{where}.cache_control" + (f".{field}" if field else "")
        raise APIError(400, f"{param}: {error['msg']}", param=param, code="invalid_value") from None


def text_content(index: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(_part_text(f"messages.{index}.content.{j}", part) for j, part in enumerate(content))


def _part_text(where: str, part: dict[str, Any]) -> str:
    """The text of the content part at `where`: only text parts, {"type": "text", "text": str}, are
    supported, with a `cache_control` mark or none; another key is refused as an unknown field is."""
    kind = part.get("type")
    if kind != "text":
        raise APIError(400, f"content part of type {kind!r} is not supported: only text parts", param=where,
                       code="unsupported_value")
    if part.get("text") is None:
        raise APIError(400, "a text content part needs its text", param=f"{where}.text", code="missing_field")
    if not isinstance(part["text"], str):
        raise APIError(400, "a text content part's text must be a string", param=f"{where}.text",
                       code="invalid_value")
    if part.get("cache_control") is not None:
        _cache_control(where, part["cache_control"])
    extra = [key for key in part if key not in ("type", "text", "cache_control")]
    if extra:
        raise APIError(400, f"unknown field `{where}.{extra[0]}`: this server does not implement it",
                       param=f"{where}.{extra[0]}", code="unknown_field")
    return part["text"]


# set by cairn: the tokenizer's render (the special tokens, its helpers, its message marker), tools, the forced
# prefix, the continued last message
RESERVED_TEMPLATE_VARIABLES = (*TEMPLATE_VARIABLES_SET_HERE, "tools", "generation_prefix", "continue_final_message")


def template_variables(chat_template_kwargs: dict[str, Any] | None, tools: list[Tool] | None) -> dict[str, Any]:
    """Variables for the chat template beside the messages: the tools and chat_template_kwargs, which may
    not set a variable cairn sets itself (RESERVED_TEMPLATE_VARIABLES: a 400 naming it)."""
    kwargs = dict(chat_template_kwargs or {})
    for reserved in RESERVED_TEMPLATE_VARIABLES:
        if reserved in kwargs:
            raise APIError(400, f"chat_template_kwargs may not set {reserved!r}",
                           param=f"chat_template_kwargs.{reserved}", code="invalid_value")
    if tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    return kwargs
