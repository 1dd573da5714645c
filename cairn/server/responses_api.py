"""POST /v1/responses: OpenAI's Responses API (the request side), so agent clients that speak only it (the
Codex CLI, the Agents SDK) can point at cairn. The answer's shapes are in `responses_output`.

A request is turned into the equivalent chat request and runs the chat path (`prepare` and
`generate.prepare_chat`; a large body in a request worker process): the same template, parsers, structured
output, prefix cache and snapshots. The conversion:

    instructions, then the leading system / developer messages   -> one system message
    message items (user, system, developer, assistant; content a string or input_text / output_text parts)
                                                                  -> chat messages (parts joined)
    reasoning items (reasoning_text, else encrypted_content, else summary) -> the next assistant message's reasoning
    function_call items (call_id, name, arguments)               -> that assistant message's tool_calls
    function_call_output items (call_id, output)                 -> tool messages
    tools (type function; `strict` defaults to true, as OpenAI's) -> chat tools
    tool_choice, parallel_tool_calls, temperature, top_p, user, metadata -> the same chat fields
    max_output_tokens -> max_completion_tokens;  text.format -> response_format
    reasoning.effort: "none" -> enable_thinking false, any other effort -> enable_thinking true (the
                      template's switch; cairn has no finer effort); reasoning.summary only "auto" (no summary
                      is generated: a reasoning item's summary is empty, its content the reasoning text)
    previous_response_id -> the stored conversation (its input and output items, not its instructions) first

`store` (default true) keeps the response in `responses_output.ResponseStore`, a bounded in-memory store, for
GET / DELETE /v1/responses/{id} and previous_response_id.

What is refused, with a 400 naming the field: tools other than functions (web_search, file_search, mcp,
custom, ...), input parts other than text (input_image, input_file, input_audio), items other than the four
above (item_reference, computer calls, ...), `include` values but "reasoning.encrypted_content", and any field
of the API cairn does not implement unless it carries its neutral value (background: false, truncation:
"disabled", ...: RESPONSES_UNIMPLEMENTED). A field the API does not define is refused as on the chat path.

`include: ["reasoning.encrypted_content"]` (what a stateless client, store false, asks for to send its reasoning
back) gives each reasoning item an `encrypted_content` that a later request's reasoning item may carry instead of
its content: ENCODED_PREFIX and the reasoning text in base64. It is opaque to the client but NOT encrypted (cairn
holds no key; the same text is in the item's content anyway); one cairn did not make is a 400.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError, model_validator

from cairn.server.bridge import Submission
from cairn.server.chat_output import ChatPlan
from cairn.server.chat_schema import FunctionName, refuse_duplicate_names
from cairn.server.errors import APIError, from_validation_errors
from cairn.server.generate import ServingContext, prepare_chat
from cairn.server.protocol import ChatCompletionRequest
from cairn.server.strict import Strict, refuse_lone_surrogates, refuse_unimplemented

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")
ENCRYPTED_REASONING = "reasoning.encrypted_content"  # the one `include` value cairn honours
ENCODED_PREFIX = "cairn-reasoning:"  # an encrypted_content cairn made: this, then the reasoning text in base64
# fields of the Responses API cairn does not implement, each with its neutral value (see strict.refuse_unimplemented)
RESPONSES_UNIMPLEMENTED: dict[str, Any] = {
    "background": False, "conversation": None, "prompt": None, "prompt_cache_retention": None,
    "service_tier": "auto", "top_logprobs": 0, "truncation": "disabled", "context_management": None,
    "moderation": None, "image": None, "access_programs": None, "background_options": None,
    "prompt_cache_options": None,
}


# ---- the request --------------------------------------------------------------------------------

class TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # (an output_text the client sends back)
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # commentary / final_answer: how a client shows it; changes nothing here


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: FunctionName
    arguments: str  # a JSON object
    id: str | None = None
    status: str | None = None
    namespace: None = None
    caller: dict[str, Any] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    status: str | None = None
    encrypted_content: str | None = None  # one cairn made (include reasoning.encrypted_content): the text

    @model_validator(mode="after")
    def _readable(self) -> ReasoningItem:
        if self.encrypted_content is not None:
            decode_reasoning(self.encrypted_content)
        return self

    def text(self) -> str:
        if self.content:
            return "".join(p.text for p in self.content)
        if self.encrypted_content is not None:
            return decode_reasoning(self.encrypted_content)
        return "".join(p.text for p in self.summary)


def encode_reasoning(text: str) -> str:
    return ENCODED_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(encoded: str) -> str:
    """The text of an encrypted_content cairn made (see the module docstring); ValueError for any other."""
    try:
        if encoded.startswith(ENCODED_PREFIX):
            return base64.b64decode(encoded[len(ENCODED_PREFIX):], validate=True).decode()
    except ValueError:
        pass
    raise ValueError("encrypted_content is not one this server made (cairn reads only its own)")


def _item_type(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = True  # OpenAI's default: the calls follow `parameters` (constrained decoding)


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
    tools: list[FunctionTool] | None = None
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
    prompt_cache_key: str | None = None  # accepted: cairn caches every prefix on its own
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
        refuse_duplicate_names([t.name for t in self.tools or ()], "tools.{}.name")
        return self

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input or ())

    def to_chat(self, prior: list[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The equivalent chat request; `prior`: the stored conversation previous_response_id names."""
        items = [_ITEMS.validate_python(item) for item in prior] + self.items()
        chat: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.instructions, items),
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "user": self.user, "metadata": self.metadata,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": t.parameters, "strict": t.strict}}
                             for t in self.tools]
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


_ITEMS: TypeAdapter[InputItem] = TypeAdapter(InputItem)  # a stored item (a dict) as its model


def refuse_unsupported_types(data: dict) -> None:
    """A 400 naming the field for a tool, tool_choice, input item or content part of a type the API defines
    and cairn does not implement (said so, rather than as a failed match of every type cairn takes)."""
    for i, tool in enumerate(_list(data.get("tools"))):
        if isinstance(tool, dict) and tool.get("type") != "function":
            _unsupported(f"tools.{i}.type", tool.get("type"), "function tools only")
    for i, value in enumerate(_list(data.get("include"))):
        if value != ENCRYPTED_REASONING:
            _unsupported(f"include.{i}", value, f"{ENCRYPTED_REASONING} only")
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        _unsupported("tool_choice.type", choice.get("type"), "none, auto, required or a function")
    for i, item in enumerate(_list(data.get("input"))):
        kind = _item_type(item)
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


def _text(content: str | list[TextPart], sep: str) -> str:
    return content if isinstance(content, str) else sep.join(p.text for p in content)


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of a conversation: the instructions and the leading system / developer messages as one
    system message, then the items (see the module docstring)."""
    system = [instructions] if instructions else []
    while items and isinstance(items[0], MessageItem) and items[0].role in ("system", "developer"):
        system.append(_text(items.pop(0).content, "\n"))
    messages = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    reasoning: str | None = None  # a reasoning item's text, for the assistant message that follows it
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if reasoning is None and messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append(_assistant("", reasoning, [call]))
        elif isinstance(item, MessageItem) and item.role == "assistant":
            messages.append(_assistant(_text(item.content, ""), reasoning))
        else:
            if reasoning is not None:  # reasoning that no answer followed: an assistant turn of its own
                messages.append(_assistant("", reasoning))
            messages.append(_other(item))
        reasoning = None
    if reasoning is not None:
        messages.append(_assistant("", reasoning))
    return messages


def _assistant(content: str, reasoning: str | None, calls: list | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _other(item: MessageItem | FunctionCallOutputItem) -> dict[str, Any]:
    if isinstance(item, FunctionCallOutputItem):
        return {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, "\n")}
    return {"role": item.role, "content": _text(item.content, "\n")}


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
    def rename(text: str) -> str:
        for pattern, name in CHAT_PATHS:
            text = pattern.sub(name, text)
        return text

    return dataclasses.replace(e, message=rename(e.message), param=e.param and rename(e.param))


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
