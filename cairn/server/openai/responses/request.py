"""POST /v1/responses: OpenAI's Responses API (the request side), so agent clients that speak only it (the
Codex CLI, the Agents SDK) can point at cairn. The answer's shapes are in `output`.

A request is turned into the equivalent chat request and runs the chat path (`prepare` and
`openai.chat.prepare_chat`; a large body in a request worker process): the same template, parsers, structured
output, prefix cache and snapshots. The conversion (the input items' is `items`):

    input (a string: one user message; or items) and instructions -> chat messages (items.chat_messages)
    tools (type function; `strict` defaults to true, as OpenAI's) -> chat tools
    namespace tools (function tools grouped under a name, as the Codex CLI sends its sub-agent tools) -> a chat tool
                      `<namespace>.<name>` per function, its description after the namespace's; a call of one comes
                      back as a function_call item with `namespace` (and a tool_choice names it `<namespace>.<name>`)
    tool_choice, parallel_tool_calls, temperature, top_p, user, metadata -> the same chat fields
    max_output_tokens -> max_completion_tokens;  text.format -> response_format
    reasoning.effort: "none" -> enable_thinking false, any other effort -> enable_thinking true (the
                      template's switch; cairn has no finer effort); reasoning.summary only "auto" (no summary
                      is generated: a reasoning item's summary is empty, its content the reasoning text)
    previous_response_id -> the stored conversation (its input and output items, not its instructions) first

`store` (default true) keeps the response in `output.ResponseStore`, a bounded in-memory store, for
GET / DELETE /v1/responses/{id} and previous_response_id.

What is refused, with a 400 naming the field: tools other than functions and namespaces of functions
(web_search, file_search, mcp, custom, ...), input parts other than text (input_image, input_file,
input_audio), items other than messages, function calls, their outputs and reasoning (item_reference,
computer calls, ...), `include` values but "reasoning.encrypted_content", and any field of the API cairn does
not implement unless it carries its neutral value (background: false, truncation: "disabled", ...:
RESPONSES_UNIMPLEMENTED). A field the API does not define is refused as on the chat path; `client_metadata`
(the Codex CLI's session tags, not in OpenAI's reference) is accepted and stored nowhere.

`include: ["reasoning.encrypted_content"]` (what a stateless client, store false, asks for to send its reasoning
back) gives each reasoning item an `encrypted_content` that a later request's reasoning item may carry instead of
its content (see `items`); one cairn did not make is a 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from cairn.server.chat.output import ChatPlan
from cairn.server.chat.schema import FunctionName, refuse_duplicate_names
from cairn.server.chat.strict import CacheSalt, Strict, refuse_lone_surrogates, refuse_unimplemented
from cairn.server.engine_io.bridge import Submission
from cairn.server.errors import APIError, from_validation_errors, renamed
from cairn.server.openai.chat import prepare_chat
from cairn.server.openai.protocol import ChatCompletionRequest
from cairn.server.openai.responses.items import (
    ITEM_TYPES,
    ITEMS,
    NAMESPACE_SEP,
    PART_TYPES,
    InputItem,
    MessageItem,
    chat_messages,
    item_type,
)
from cairn.server.serving import ServingContext

TOOL_TYPES = ("function", "namespace")
ENCRYPTED_REASONING = "reasoning.encrypted_content"  # the one `include` value cairn honours
# fields of the Responses API cairn does not implement, each with its neutral value (see strict.refuse_unimplemented)
RESPONSES_UNIMPLEMENTED: dict[str, Any] = {
    "background": False, "conversation": None, "prompt": None, "prompt_cache_retention": None,
    "service_tier": "auto", "top_logprobs": 0, "truncation": "disabled", "context_management": None,
    "moderation": None, "image": None, "access_programs": None, "background_options": None,
    "prompt_cache_options": None,
}


# ---- the request --------------------------------------------------------------------------------

class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = True  # OpenAI's default: the calls follow `parameters` (constrained decoding)


class NamespaceTool(Strict):
    """Function tools grouped under a name: each is the chat tool `<namespace>.<name>` (NAMESPACE_SEP), its
    description after the namespace's; a call of one comes back as a function_call with `namespace`."""

    type: Literal["namespace"]
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\s<>.]+$")]
    description: str
    tools: list[FunctionTool] = Field(min_length=1)

    def chat_tools(self) -> list[FunctionTool]:
        return [t.model_copy(update={"name": f"{self.name}{NAMESPACE_SEP}{t.name}",
                                     "description": "\n\n".join(filter(None, (self.description, t.description)))})
                for t in self.tools]


def _tool_type(tool: Any) -> str:
    return tool.get("type", "") if isinstance(tool, dict) else ""


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[NamespaceTool, Tag("namespace")],
                 Discriminator(_tool_type)]


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the neutral value: cairn cannot make an answer terser or longer


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto"] | None = None  # "auto": cairn has no summarizer, the summary is empty
    generate_summary: Literal["auto"] | None = None  # (the older name of summary)


class StreamOptions(Strict):
    include_obfuscation: Literal[False] | None = None  # cairn adds no obfuscation field to its events


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None  # bounds built-in tool calls, of which cairn makes none
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None  # echoed in the response and stored with it
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    user: str | None = None
    safety_identifier: str | None = None  # stored nowhere
    client_metadata: dict[str, str] | None = None  # the client's own tags (the Codex CLI's session ids): stored nowhere
    prompt_cache_key: str | None = None  # `cairn router`'s routing key (see the chat request's)
    cache_salt: CacheSalt | None = None  # cairn / vLLM extension: requests of another salt share no cached prefix
    store: bool = True
    previous_response_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refusals(cls, data: Any) -> Any:
        data = refuse_unimplemented(refuse_lone_surrogates(data), fields=RESPONSES_UNIMPLEMENTED)
        if isinstance(data, dict):
            refuse_unsupported_types(data)
        return data

    @model_validator(mode="after")
    def _checks(self) -> ResponsesRequest:
        if self.input is None and self.previous_response_id is None:
            raise APIError(400, "input is required (without a previous_response_id)", param="input",
                           code="missing_field")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                           code="invalid_value")
        named = self._named_chat_tools()
        refuse_duplicate_names([t.name for _, t in named], [path for path, _ in named])
        return self

    def chat_tools(self) -> list[FunctionTool]:
        """The function tools as the chat sees them: a namespace's flattened to `<namespace>.<name>`."""
        return [t for _, t in self._named_chat_tools()]

    def _named_chat_tools(self) -> list[tuple[str, FunctionTool]]:
        """chat_tools, each with the path of its name in this request (tools.I.name, tools.I.tools.J.name)."""
        named = []
        for i, tool in enumerate(self.tools or ()):
            if isinstance(tool, NamespaceTool):
                named += [(f"tools.{i}.tools.{j}.name", t) for j, t in enumerate(tool.chat_tools())]
            else:
                named.append((f"tools.{i}.name", tool))
        return named

    def call_name(self, name: str) -> tuple[str | None, str]:
        """(namespace, name) of a call of the chat tool `name` (namespace None for a plain function tool)."""
        namespace, sep, rest = name.partition(NAMESPACE_SEP)  # (a plain tool of this name would be a duplicate)
        if sep and any(isinstance(t, NamespaceTool) and t.name == namespace for t in self.tools or ()):
            return namespace, rest
        return None, name

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input or ())

    def to_chat(self, prior: list[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The equivalent chat request; `prior`: the stored conversation previous_response_id names."""
        items = [ITEMS.validate_python(item) for item in prior] + self.items()
        chat: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.instructions, items),
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "user": self.user, "metadata": self.metadata,
                                "parallel_tool_calls": self.parallel_tool_calls, "cache_salt": self.cache_salt}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": t.parameters, "strict": t.strict}}
                             for t in self.chat_tools()]
        if self.tool_choice is not None:
            chat["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                   {"type": "function", "function": {"name": self.tool_choice.name}})
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = _response_format(self.text.format)
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": self.reasoning.effort != "none"}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:  # a value this API's fields take and the chat request's do not
            raise from_validation_errors(e.errors(include_url=False)) from None




def refuse_unsupported_types(data: dict) -> None:
    """A 400 naming the field for a tool, tool_choice, input item or content part of a type the API defines
    and cairn does not implement (said so, rather than as a failed match of every type cairn takes)."""
    for i, tool in enumerate(_list(data.get("tools"))):
        if isinstance(tool, dict) and tool.get("type") not in TOOL_TYPES:
            _unsupported(f"tools.{i}.type", tool.get("type"), "function and namespace tools only")
        for j, inner in enumerate(_list(tool.get("tools")) if isinstance(tool, dict) else ()):
            if isinstance(inner, dict) and inner.get("type") != "function":
                _unsupported(f"tools.{i}.tools.{j}.type", inner.get("type"), "function tools only")
    for i, value in enumerate(_list(data.get("include"))):
        if value != ENCRYPTED_REASONING:
            _unsupported(f"include.{i}", value, f"{ENCRYPTED_REASONING} only")
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        _unsupported("tool_choice.type", choice.get("type"), "none, auto, required or a function")
    for i, item in enumerate(_list(data.get("input"))):
        if not isinstance(item, dict):
            continue  # (not an item: the model's validation names it)
        kind = item_type(item)
        if kind not in ITEM_TYPES:
            _unsupported(f"input.{i}.type", kind, ", ".join(ITEM_TYPES) + " items")
        content = item.get("content") if kind == "message" else item.get("output")
        for j, part in enumerate(_list(content)):
            if isinstance(part, dict) and part.get("type") not in PART_TYPES:
                _unsupported(f"input.{i}.{'content' if kind == 'message' else 'output'}.{j}.type", part.get("type"),
                             "text parts only")


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _unsupported(param: str, value: Any, takes: str) -> None:
    raise APIError(400, f"{param} {json.dumps(value)[:60]} is not supported by this server ({takes})", param=param,
                   code="unsupported_value")


def _response_format(f: TextFormat) -> dict[str, Any]:
    if f.type != "json_schema":
        return {"type": f.type}
    if f.schema_ is None:
        raise APIError(400, "text.format type json_schema needs a schema", param="text.format.schema",
                       code="missing_field")
    return {"type": "json_schema", "json_schema": {"name": f.name, "description": f.description,
                                                   "schema": f.schema_, "strict": f.strict}}


# ---- preparing it as a chat ---------------------------------------------------------------------

class NeedsHistory(Exception):  # noqa: N818 (a request, not a failure: see prepare_responses)
    """Raised (in a request worker) for a body with previous_response_id prepared without the store: the
    server looks the conversation up and prepares it again, giving it."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


Lookup = Callable[[str], list[dict[str, Any]] | None]

# the chat request's field paths as this API names them, for an error the chat's checks raise
CHAT_PATHS = ((re.compile(r"\btools\.(\d+)\.function\.(\w+)"), r"tools.\1.\2"),
              (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
              (re.compile(r"\bmessages(\.\d+)?(\.[\w.]+)?"), "input"),
              (re.compile(r"\bmax_completion_tokens\b|\bmax_tokens\b"), "max_output_tokens"),
              (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "text.format.schema"),
              (re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
              (re.compile(r"\bchat_template_kwargs\b"), "reasoning.effort"))


def in_responses_names(e: APIError) -> APIError:
    """`e`, raised by the equivalent chat request's checks, naming the fields this request sent."""
    return renamed(e, CHAT_PATHS)


def previous_not_found(response_id: str) -> APIError:
    return APIError(404, f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                    code="previous_response_not_found")


def prepare_responses(ctx: ServingContext, body: ResponsesRequest, request_id: str,
                      lookup: Lookup | None) -> tuple[Submission, ChatPlan]:
    """prepare_chat of the equivalent chat request (errors naming this API's fields). `lookup`: the stored
    conversation of a response id (None where it is not at hand: NeedsHistory is raised for a body that
    needs one)."""
    prior: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        if lookup is None:
            raise NeedsHistory(body.previous_response_id)
        found = lookup(body.previous_response_id)
        if found is None:
            raise previous_not_found(body.previous_response_id)
        prior = found
    try:
        return prepare_chat(ctx, body.to_chat(prior), request_id)
    except APIError as e:
        raise in_responses_names(e) from None
