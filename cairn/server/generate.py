"""The generation endpoints: validate, submit to the engine bridge, answer whole or as an SSE stream.

A request is submitted before any response byte is sent, so every error add_request raises becomes
a 4xx JSON error with the right status. After that:
- non-streamed: outputs are gathered while watching for the client to go away (then the request is
  aborted and its memory freed);
- streamed: one SSE event per engine output, `data: [DONE]` at the end; an error after the stream
  started (engine failure, shutdown) is sent as a last `data: {"error": ...}` event. However the
  stream ends (finished, client gone, cancelled at shutdown), the request is aborted if unfinished.

Token timing (TTFT, inter-token latency) and token counters are recorded here, as the client sees them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cairn.outputs import RequestOutput
from cairn.server.bridge import EngineBridge, RequestStream, Submission
from cairn.server.errors import APIError, EngineFailure, ServerShuttingDown, from_exception, model_not_found
from cairn.server.metrics import ServerMetrics
from cairn.server.protocol import ChatCompletionRequest, CompletionRequest
from cairn.server.responses import (
    DONE_EVENT,
    ResponseHeader,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    usage_chunk,
)
from cairn.tokenizer import Tokenizer


@dataclass
class ServingContext:
    """What the endpoints need from the app."""

    bridge: EngineBridge
    metrics: ServerMetrics
    tokenizer: Tokenizer  # only decode() is used here, for logprob token texts (pure, thread-safe)
    served_model: str  # the name clients send and responses carry
    model_aliases: frozenset[str]  # other names accepted for the same model
    max_model_len: int
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json values for omitted fields

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model and name not in self.model_aliases:
            raise model_not_found(name)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """An SSE stream that calls `on_close` however it ends (finished, client gone or cancelled)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Generation:
    """One submitted request: its stream, timing and metrics."""

    def __init__(self, ctx: ServingContext, stream: RequestStream, header: ResponseHeader, start_s: float):
        self.ctx, self.stream, self.header, self.start_s = ctx, stream, header, start_s
        self._last_token_s: float | None = None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs, recording TTFT / inter-token latency and, at the end, its token counts."""
        metrics, is_first = self.ctx.metrics, True
        async for out in self._counting_failures():
            now = time.monotonic()
            if out.delta_token_ids:
                if self._last_token_s is None:
                    metrics.ttft.observe(now - self.start_s)
                else:
                    metrics.itl.observe(now - self._last_token_s)
                self._last_token_s = now
            metrics.observe_output(out, is_first, now - self.start_s)
            is_first = False
            yield out

    async def _counting_failures(self) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.stream:
                yield out
        except EngineFailure:
            self.ctx.metrics.finished.labels("error").inc()
            raise
        except ServerShuttingDown:
            self.ctx.metrics.finished.labels("abort").inc()
            raise

    def close(self) -> None:
        if not self.stream.done:
            self.ctx.metrics.finished.labels("abort").inc()
        self.stream.close()

    async def final_outputs(self, request: Request) -> list[RequestOutput]:
        """The finished output of every choice, by index; if the client disconnects first, abort and
        raise a 499."""
        gather = asyncio.ensure_future(_finals(self.outputs()))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not gather.done():
                gather.cancel()
                self.close()
        if gather.cancelled():
            raise APIError(499, "The client closed the connection.", code="client_closed")
        return gather.result()


async def _finals(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for out in outputs:
        if out.finished:
            finals[out.index] = out
    return [finals[i] for i in sorted(finals)]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _with_choices(bodies: list[dict], outs: list[RequestOutput]) -> dict:
    """One response holding every choice of an n > 1 request: each body's choice with its index, the
    usage counting every choice's tokens (the prompt once)."""
    body = bodies[0]
    body["choices"] = [{**b["choices"][0], "index": out.index} for b, out in zip(bodies, outs, strict=True)]
    if body.get("usage"):
        _count_all_choices(body["usage"], outs)
    return body


def _count_all_choices(usage: dict, outs: list[RequestOutput]) -> None:
    usage["completion_tokens"] = sum(len(o.token_ids) for o in outs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def _indexed(chunk: dict, index: int) -> dict:
    """A one-choice stream chunk for choice `index` of the request."""
    chunk["choices"][0]["index"] = index
    return chunk


def _delta_slice(out: RequestOutput) -> slice:
    start = len(out.token_ids) - len(out.delta_token_ids)
    return slice(start, start + len(out.delta_token_ids))


async def _start(ctx: ServingContext, sub: Submission, start_s: float) -> Generation:
    stream = await ctx.bridge.submit(sub)
    header = ResponseHeader(id=sub.request_id, created=int(time.time()), model=ctx.served_model)
    return Generation(ctx, stream, header, start_s)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- /v1/chat/completions -----------------------------------------------------------------------

async def chat_completions(ctx: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    start_s = time.monotonic()
    ctx.check_model(body.model)
    params = body.to_sampling_params(context_fill_tokens=ctx.max_model_len, defaults=ctx.sampling_defaults)
    sub = Submission(_new_id("chatcmpl"), params, messages=body.template_messages(),
                     fit_max_tokens=body.requested_max_tokens is None)
    gen = await _start(ctx, sub, start_s)
    if body.stream:
        return SSEResponse(_chat_events(gen, body, params.n), gen.close)
    outs = await gen.final_outputs(request)
    bodies = [chat_response(gen.header, out, chat_logprobs(ctx.tokenizer, out.token_ids, out.logprobs,
                                                          out.top_logprobs) if body.logprobs else None)
              for out in outs]
    return JSONResponse(_with_choices(bodies, outs))


async def _chat_events(gen: Generation, body: ChatCompletionRequest, n: int) -> AsyncIterator[str]:
    for index in range(n):
        yield sse(_indexed(chat_chunk(gen.header, {"role": "assistant", "content": ""}), index))
    finals: dict[int, RequestOutput] = {}
    try:
        async for out in gen.outputs():
            span = _delta_slice(out)
            logprobs = (chat_logprobs(gen.ctx.tokenizer, out.delta_token_ids, out.logprobs[span],
                                      out.top_logprobs[span]) if body.logprobs and out.delta_token_ids else None)
            if out.delta_text or logprobs or out.finished:
                delta = {"content": out.delta_text} if out.delta_text else {}
                chunk = chat_chunk(gen.header, delta, out.finish_reason if out.finished else None, logprobs)
                yield sse(_indexed(chunk, out.index))
            if out.finished:
                finals[out.index] = out
    except Exception as e:
        yield sse(from_exception(e).body())
    else:
        if body.include_usage and finals:
            yield sse(_usage_chunk(gen.header, "chat.completion.chunk", list(finals.values())))
    yield DONE_EVENT


def _usage_chunk(header: ResponseHeader, obj: str, finals: list[RequestOutput]) -> dict:
    chunk = usage_chunk(header, obj, finals[0])
    _count_all_choices(chunk["usage"], finals)
    return chunk


# ---- /v1/completions ----------------------------------------------------------------------------

async def completions(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    start_s = time.monotonic()
    ctx.check_model(body.model)
    params = body.to_sampling_params(defaults=ctx.sampling_defaults)
    gen = await _start(ctx, Submission(_new_id("cmpl"), params, prompt=body.engine_prompt()), start_s)
    if body.stream:
        return SSEResponse(_completion_events(gen, body), gen.close)
    outs = await gen.final_outputs(request)
    bodies = [completion_response(gen.header, out, completion_logprobs(
        ctx.tokenizer, out.token_ids, out.logprobs, out.top_logprobs, 0) if body.logprobs is not None else None)
        for out in outs]
    return JSONResponse(_with_choices(bodies, outs))


async def _completion_events(gen: Generation, body: CompletionRequest) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    offset_chars: dict[int, int] = {}  # per choice
    try:
        async for out in gen.outputs():
            logprobs = None
            if body.logprobs is not None and out.delta_token_ids:
                span = _delta_slice(out)
                logprobs = completion_logprobs(gen.ctx.tokenizer, out.delta_token_ids, out.logprobs[span],
                                               out.top_logprobs[span], offset_chars.get(out.index, 0))
                offset_chars[out.index] = offset_chars.get(out.index, 0) + sum(len(t) for t in logprobs["tokens"])
            if out.delta_text or logprobs or out.finished:
                chunk = completion_chunk(gen.header, out.delta_text, out.finish_reason if out.finished else None,
                                         logprobs)
                yield sse(_indexed(chunk, out.index))
            if out.finished:
                finals[out.index] = out
    except Exception as e:
        yield sse(from_exception(e).body())
    else:
        if body.include_usage and finals:
            yield sse(_usage_chunk(gen.header, "text_completion", list(finals.values())))
    yield DONE_EVENT
