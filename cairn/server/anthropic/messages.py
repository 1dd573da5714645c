"""POST /v1/messages: the Anthropic Messages API, so Anthropic-API coding agents can point at cairn.

A request is turned into the equivalent chat request (system, user / assistant turns, `tool_use` ->
assistant tool_calls, `tool_result` -> tool messages, `thinking` -> reasoning_content, `thinking`
config -> the template's enable_thinking, `stop_sequences` -> stop, a last assistant message (a prefill)
-> continue_final_message: the answer continues its text) and runs the chat path
(`prepare` and `openai.chat.prepare_chat`; a large body in a request worker process): the same template,
parsers, prefix cache and snapshots. The answer comes back as content blocks (`thinking`, `text`,
`tool_use`), whole or as Anthropic's SSE events:

    message_start, then per block: content_block_start, content_block_delta..., content_block_stop,
    then message_delta (stop_reason, usage) and message_stop.

`output_config.format` (structured output, what the client's messages.parse sends) is the chat's
response_format json_schema: the text block is JSON valid for its schema (after the thinking block,
if any); `output_config.effort` is accepted null or "high" (Anthropic's default; cairn has no other level).
`context_management` edits: `clear_thinking_20251015` is carried out, others refused (see `context`).
usage: `input_tokens` counts the prompt tokens computed, `cache_read_input_tokens` those resumed from
cairn's prefix cache (the same figure as OpenAI's cached_tokens); cairn has no separate cache write
(`cache_creation_input_tokens` is 0), `cache_control` marks are accepted and change nothing. The
thinking `budget_tokens` is enforced when the template opens the thinking block (Qwen3.5, the demo
model): after that many thinking tokens `</think>` is forced and the answer follows (the chat path's
`thinking_token_budget`); max_tokens still bounds thinking and answer together. The sampling fields
older clients send (temperature, top_p, top_k) are honoured within this API's ranges (temperature and top_p
0-1, top_k >= 0; outside them a 400 naming the field, as Anthropic answers).
Errors have Anthropic's shape {"type": "error", "error": {"type", "message"}}.

POST /v1/messages/count_tokens (`count_tokens`): the prompt tokens a Messages request with these fields
would send ({"input_tokens": N}), rendered and tokenized as that request would be.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, Field, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cairn.engine.outputs import Completion
from cairn.server.anthropic.context import ContextManagement
from cairn.server.chat.output import ChatDelta, ChatPlan, ChatShaper, tool_arguments
from cairn.server.chat.schema import FunctionName, refuse_duplicate_names
from cairn.server.chat.strict import Strict, refuse_lone_surrogates, refuse_unimplemented
from cairn.server.engine_io.bridge import Submission
from cairn.server.errors import APIError, from_exception, from_validation_errors, renamed
from cairn.server.openai.chat import prepare_chat
from cairn.server.openai.protocol import ChatCompletionRequest
from cairn.server.serving import Generation, ServingContext, SSEResponse, start_generation

log = logging.getLogger(__name__)


# ---- the request --------------------------------------------------------------------------------

class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class DirectCaller(Strict):
    type: Literal["direct"]  # the model called the tool itself: every call cairn returns


class ToolUseBlock(Strict):
    """Also as the anthropic client dumps its own response blocks: with `caller` and `toolset_name` null."""

    type: Literal["tool_use"]
    id: str
    name: FunctionName
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: DirectCaller | None = None
    toolset_name: None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None
    toolset_name: None = None


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant", "system"]  # system: a mid-conversation system message (Claude Code's)
    content: str | list[Block]


class AnthropicTool(Strict):
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # true: the tool_use input follows input_schema (constrained decoding)
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


def _unique_tool_names(tools: list[AnthropicTool]) -> list[AnthropicTool]:
    refuse_duplicate_names([t.name for t in tools], "tools.{}.name")
    return tools


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool: the tool a call must be made to (only there)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_only_with_tool(self) -> ToolChoice:
        if self.name is not None and self.type != "tool":
            raise APIError(400, f"tool_choice name is only read with type tool, not {self.type}",
                           param="tool_choice.name", code="invalid_value")
        return self


class ThinkingConfig(Strict):
    type: Literal["enabled", "adaptive", "disabled"]  # enabled / adaptive: the template's enable_thinking
    budget_tokens: int | None = Field(None, ge=0)  # enabled (only there): most thinking tokens, then it is ended
    display: Literal["summarized"] | None = None  # thinking is returned as generated

    @model_validator(mode="after")
    def _budget_only_when_enabled(self) -> ThinkingConfig:
        if self.budget_tokens is not None and self.type != "enabled":
            raise APIError(400, f"thinking budget_tokens is only read with type enabled, not {self.type}",
                           param="thinking.budget_tokens", code="invalid_value")
        return self


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")  # JSON Schema the answer's text follows (constrained decoding)


class OutputConfig(Strict):
    format: OutputFormat | None = None  # structured output: the chat's response_format json_schema
    effort: Literal["high"] | None = None  # Anthropic's default (what Claude Code sends); no other level is honoured


class Metadata(Strict):
    user_id: str | None = None  # stored nowhere


class PromptFields(Strict):
    """The fields of a Messages request that make its prompt (all that /v1/messages/count_tokens takes)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], AfterValidator(_unique_tool_names)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: dict[str, Any] | None = None  # accepted; cairn caches every prefix on its own
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None  # clear_thinking honoured (see anthropic.context)

    @model_validator(mode="before")
    @classmethod
    def _unimplemented(cls, data: Any) -> Any:
        return refuse_unimplemented(refuse_lone_surrogates(data))

    @model_validator(mode="after")
    def _system_between_turns(self) -> PromptFields:
        if self.messages[0].role == "system":  # a system message stands between turns; the first goes in `system`
            raise APIError(400, "the first message cannot be a system message (a system prompt goes in `system`)",
                           param="messages.0.role", code="invalid_value")
        return self


class MessagesRequest(PromptFields):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range (the chat API's is 0-2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _no_stop_in_a_constrained_answer(self) -> MessagesRequest:
        """The chat checks (ChatCompletionRequest.check_tools), said in this API's names."""
        forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
        structured = self.output_config is not None and self.output_config.format is not None
        if structured and forced:
            raise APIError(400, "output_config.format cannot be combined with a tool_choice that forces a call",
                           param="output_config.format", code="invalid_value")
        if self.stop_sequences and (forced or structured):
            what = "a tool_choice that forces a call" if forced else "output_config.format"
            raise APIError(400, f"stop_sequences cannot be combined with {what}: the whole output is constrained, "
                                "and a stop inside it would end it invalid", param="stop_sequences",
                           code="invalid_value")
        return self

    def to_chat(self) -> ChatCompletionRequest:
        """The equivalent chat request."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for m in self.messages:
            messages += _chat_messages(m)
        if self.context_management is not None:
            self.context_management.apply(messages)
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                                "stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p,
                                "top_k": self.top_k}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": t.input_schema, "strict": t.strict}}
                             for t in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = _tool_choice(self.tool_choice)
            chat["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.thinking is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
            if self.thinking.type == "enabled":
                chat["thinking_token_budget"] = self.thinking.budget_tokens
        if self.output_config is not None and self.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        if self.messages[-1].role == "assistant":
            self._check_prefill()
            chat["continue_final_message"] = True
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:  # a value this API's fields take and the chat request's do not
            raise from_validation_errors(e.errors(include_url=False)) from None

    def _check_prefill(self) -> None:
        """A last assistant message is a prefill: the answer continues its text (`continue_final_message`),
        so it holds text alone, no thinking comes before the answer and no structured output's grammar
        (which starts an answer afresh) constrains it."""
        index, last = len(self.messages) - 1, self.messages[-1]
        kinds = [] if isinstance(last.content, str) else [b.type for b in last.content if b.type != "text"]
        if kinds:
            raise APIError(400, f"a last assistant message (a prefill, which the answer continues) may hold text "
                                f"blocks only, not {kinds[0]}", param=f"messages.{index}.content", code="invalid_value")
        if self.output_config is not None and self.output_config.format is not None:
            raise APIError(400, "output_config.format cannot be combined with a last assistant message (a prefill): "
                                "its grammar starts the answer afresh", param="output_config.format",
                           code="invalid_value")
        if self.thinking is not None and self.thinking.type != "disabled":
            raise APIError(400, f"thinking {self.thinking.type} cannot be combined with a last assistant message (a "
                                "prefill): the answer continues its text, after no thinking", param="thinking",
                           code="invalid_value")


# the chat request's field paths as this API names them, for an error the chat's checks raise (`prepare_messages`)
CHAT_PATHS = ((re.compile(r"\btools\.(\d+)\.function\.parameters\b"), r"tools.\1.input_schema"),
              (re.compile(r"\btools\.(\d+)\.function\.name\b"), r"tools.\1.name"),
              (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "output_config.format.schema"),
              (re.compile(r"\bresponse_format\b"), "output_config.format"),
              (re.compile(r"\bthinking_token_budget\b"), "thinking.budget_tokens"))


def in_anthropic_names(e: APIError) -> APIError:
    """`e`, raised by the equivalent chat request's checks, naming the fields this request sent."""
    return renamed(e, CHAT_PATHS)


def prepare_messages(ctx: ServingContext, body: MessagesRequest | CountTokensRequest,
                     request_id: str) -> tuple[Submission, ChatPlan]:
    """prepare_chat of the equivalent chat request; an error it raises names this API's fields."""
    try:
        return prepare_chat(ctx, body.to_chat(), request_id)
    except APIError as e:
        raise in_anthropic_names(e) from None


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice type tool needs a name", param="tool_choice.name", code="invalid_value")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _chat_messages(m: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts = [b.text for b in m.content if isinstance(b, TextBlock)]
    if m.role == "system":  # rendered where it stands, as the chat template renders a system message there
        if len(texts) != len(m.content):
            raise APIError(400, "a system message may hold text blocks only", param="messages", code="invalid_value")
        return [{"role": "system", "content": "\n".join(texts)}]
    if m.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        thinking = [b.thinking for b in m.content if isinstance(b, ThinkingBlock)]
        if thinking:
            out["reasoning_content"] = "".join(thinking)
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in m.content if isinstance(b, ToolUseBlock)]
        if calls:
            out["tool_calls"] = calls
        return [out]
    if any(isinstance(b, ToolUseBlock | ThinkingBlock) for b in m.content):
        raise APIError(400, "a user message cannot carry tool_use or thinking blocks", param="messages",
                       code="invalid_value")
    out_messages = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}
                    for b in m.content if isinstance(b, ToolResultBlock)]
    if texts or not out_messages:
        out_messages.append({"role": "user", "content": "\n".join(texts)})
    return out_messages


def _result_text(b: ToolResultBlock) -> str:
    text = b.content if isinstance(b.content, str) else "\n".join(t.text for t in b.content or ())
    return f"Error: {text}" if b.is_error else text


# ---- the answer ---------------------------------------------------------------------------------

def _usage(out: Completion) -> dict[str, int]:
    cached = out.cache.cached_tokens
    return {"input_tokens": out.num_prompt_tokens - cached, "output_tokens": len(out.token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(ctx: ServingContext, shaper: ChatShaper, out: Completion, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer: the chat's finish reason (see
    ChatShaper.finish_reason) in Anthropic's words."""
    reason = shaper.finish_reason(out.finish_reason)
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if stops:
        text = ctx.tokenizer.decode(out.token_ids)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            return "stop_sequence", min(hits)[1]
    return "end_turn", None


def _blocks(message: ChatDelta) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning:
        blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    if message.content or not (message.reasoning or message.calls):
        blocks.append({"type": "text", "text": message.content})
    blocks += [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": tool_arguments(c)}
               for c in message.calls]
    return blocks


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _message(msg_id: str, model: str, content: list, out: Completion | None,
             stop: tuple[str | None, str | None]) -> dict[str, Any]:
    usage = _usage(out) if out is not None else {"input_tokens": 0, "output_tokens": 0}
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


class CountTokensRequest(PromptFields):
    """/v1/messages/count_tokens: a Messages request's prompt fields alone."""

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request of a Messages request with these fields (its prompt: max_tokens does not enter it)."""
        return MessagesRequest.model_construct(**dict(self), max_tokens=1).to_chat()


async def count_tokens(ctx: ServingContext, body: CountTokensRequest) -> dict:
    """{"input_tokens": N}: the prompt a Messages request with `body`'s fields would send, rendered and
    tokenized as it would be (off the event loop), the generation prompt and a forced call's prefix included."""
    sub, _ = prepare_messages(ctx, body, "count_tokens")
    prompt = await ctx.bridge.tokenize(sub)
    return {"input_tokens": len(prompt.token_ids)}


async def messages(ctx: ServingContext, sub: Submission, plan: ChatPlan, body: MessagesRequest, request: Request,
                   start_s: float) -> Response:
    """A Messages request prepared as a chat (`cairn.server.prepare`; `body`: its stream and stop fields)."""
    gen, shaper = await start_generation(ctx, sub, start_s), ChatShaper(plan)
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        return SSEResponse(_events(ctx, gen, shaper, body, msg_id), gen.close)
    (out,) = await gen.final_outputs(request)  # one choice: the Messages API has no n
    shaper.feed(out.text, final=True)
    stop = _stop(ctx, shaper, out, body.stop_sequences or [])
    return JSONResponse(_message(msg_id, ctx.served_model, _blocks(shaper.message), out, stop))


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n"


class _BlockStream:
    """Opens, feeds and closes content blocks as the kind of text changes."""

    def __init__(self):
        self.index, self.kind = -1, None

    def switch(self, kind: str, start: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        events.append(_event("content_block_start", {"index": self.index, "content_block": start}))
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(self.delta({"type": "signature_delta", "signature": ""}))
        self.kind = None
        return [*events, _event("content_block_stop", {"index": self.index})]

    def delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def pieces(self, d: ChatDelta) -> list[str]:
        events: list[str] = []
        if d.reasoning:
            if self.kind != "thinking":
                events += self.switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.kind != "text":
                events += self.switch("text", {"type": "text", "text": ""})
            events.append(self.delta({"type": "text_delta", "text": d.content}))
        for c in d.calls:
            events += self.switch("tool_use", {"type": "tool_use", "id": _tool_id(c.id), "name": c.name,
                                               "input": {}})
            events.append(self.delta({"type": "input_json_delta", "partial_json": c.arguments}))
        return events


async def _events(ctx: ServingContext, gen: Generation, shaper: ChatShaper, body: MessagesRequest,
                  msg_id: str) -> AsyncIterator[str]:
    blocks, started = _BlockStream(), False
    try:
        async for out in gen.outputs():
            answer = gen.answer(out.index)  # the answer so far, out included
            if not started:
                started = True
                yield _event("message_start", {"message": _message(msg_id, ctx.served_model, [], answer,
                                                                   (None, None))})
            pieces = blocks.pieces(shaper.feed(out.delta_text, final=out.finished))
            if out.finished:
                if blocks.index < 0:  # an empty answer still has one (empty) text block
                    pieces += blocks.switch("text", {"type": "text", "text": ""})
                pieces += blocks.close()
                stop_reason, stop_sequence = _stop(ctx, shaper, answer, body.stop_sequences or [])
                pieces.append(_event("message_delta", {"delta": {"stop_reason": stop_reason,
                                                                 "stop_sequence": stop_sequence},
                                                       "usage": _usage(answer)}))
                pieces.append(_event("message_stop", {}))
            for piece in pieces:
                yield piece
    except Exception as e:
        yield _event("error", {"error": from_exception(e).anthropic_body()["error"]})


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.anthropic_body(), status_code=e.status, headers=e.headers)


async def guarded(handler: Awaitable[Response]) -> Response:
    """Await a handler; any exception but RequestValidationError (which FastAPI's handler answers)
    becomes an Anthropic-shaped error response (5xx are logged)."""
    try:
        return await handler
    except RequestValidationError:
        raise
    except Exception as e:
        error = from_exception(e, "messages")
        if error.status >= 500:
            log.exception("request failed: %s", error.message)
        return error_response(error)
