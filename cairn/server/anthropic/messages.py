"""POST /v1/messages: the Anthropic Messages API, so Anthropic-API coding agents can point at cairn.

A request (`request`: its models and the equivalent chat request; a last assistant message is a prefill,
which the answer continues) runs the chat path
(`prepare` and `openai.chat.prepare_chat`; a large body in a request worker process): the same template,
parsers, prefix cache and snapshots. The answer comes back as content blocks (`thinking`, `text`,
`tool_use`), whole or as Anthropic's SSE events:

    message_start, then per block: content_block_start, content_block_delta..., content_block_stop,
    then message_delta (stop_reason, usage) and message_stop.

`output_config.format` (structured output, what the client's messages.parse sends) is the chat's
response_format json_schema: the text block is JSON valid for its schema (after the thinking block,
if any); `output_config.effort` is accepted null or "high" (Anthropic's default; cairn has no other level).
`context_management` edits: `clear_thinking_20251015` is carried out, others refused (see `context`).
usage, in Anthropic's terms: `cache_read_input_tokens` counts the prompt tokens resumed from cairn's prefix cache
(the same figure as OpenAI's cached_tokens), `cache_creation_input_tokens` those this request stored at its
`cache_control` breakpoints (from the resume point to the deepest breakpoint whose snapshot it newly took; 0 when
it took none), `input_tokens` the rest of the prompt: the three add up to the prompt's tokens. `usage.cairn` is
cairn's report of the cache (resume position, tier, placement source, ...), as on the OpenAI routes. The
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
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cairn.engine.outputs import Completion
from cairn.server.anthropic.request import CountTokensRequest, MessagesRequest, prepare_messages
from cairn.server.chat.output import ChatDelta, ChatPlan, ChatShaper, tool_arguments
from cairn.server.engine_io.bridge import Submission
from cairn.server.errors import APIError, from_exception
from cairn.server.openai.response_bodies import usage_of
from cairn.server.serving import Generation, ServingContext, SSEResponse, start_generation

log = logging.getLogger(__name__)


def _usage(out: Completion) -> dict[str, Any]:
    """The usage of an answer (so far): the prompt's tokens as read from the cache, stored at the request's
    breakpoints and the rest, which add up to them; cairn's cache report beside."""
    cached = out.cache.cached_tokens
    created = max(0, out.cache.breakpoint_stored - cached) if out.cache.breakpoint_stored else 0
    return {"input_tokens": out.num_prompt_tokens - cached - created, "output_tokens": len(out.token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": created,
            "cairn": usage_of(out).cairn.model_dump()}


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
