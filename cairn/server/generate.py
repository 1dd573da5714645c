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
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cairn.outputs import RequestOutput
from cairn.server.bridge import EngineBridge, RequestStream, Submission
from cairn.server.chat_output import ChatShaper, openai_deltas, openai_message, plan_chat
from cairn.server.errors import APIError, EngineFailure, ServerShuttingDown, from_exception, model_not_found
from cairn.server.metrics import ServerMetrics
from cairn.server.middleware import current_request_id
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
    vocab_size: int = 1 << 62  # token ids in requests must be below this
    reasoning_parser: str = "qwen3"  # "qwen3": <think> text becomes reasoning_content; "none": all content
    tool_call_parser: str = "qwen3"  # "qwen3": <tool_call> blocks become tool_calls; "none": all content

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

    async def last_output(self, request: Request) -> RequestOutput:
        """The finished output; if the client disconnects first, abort and raise a 499."""
        gather = asyncio.ensure_future(_last(self.outputs()))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            client_left = not gather.done()  # (a cancel takes effect later: test before cancelling)
            if client_left:
                gather.cancel()
                self.close()
        if client_left:
            raise APIError(499, "The client closed the connection.", code="client_closed")
        return gather.result()


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    return last


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _delta_slice(out: RequestOutput) -> slice:
    start = len(out.token_ids) - len(out.delta_token_ids)
    return slice(start, start + len(out.delta_token_ids))


async def _start(ctx: ServingContext, sub: Submission, start_s: float) -> Generation:
    stream = await ctx.bridge.submit(sub)
    header = ResponseHeader(id=sub.request_id, created=int(time.time()), model=ctx.served_model)
    return Generation(ctx, stream, header, start_s)


def _new_id(prefix: str) -> str:
    """A unique request id; it holds the client's X-Request-Id when one was sent, for the logs."""
    client_id = current_request_id()
    return f"{prefix}-{client_id}-{uuid.uuid4().hex[:8]}" if client_id else f"{prefix}-{uuid.uuid4().hex}"


# ---- /v1/chat/completions -----------------------------------------------------------------------

async def chat_completions(ctx: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    start_s = time.monotonic()
    gen, shaper = await start_chat(ctx, body, start_s, "chatcmpl")
    if body.stream:
        return SSEResponse(_chat_events(gen, body, shaper), gen.close)
    out = await gen.last_output(request)
    shaper.feed(out.text, final=True)
    logprobs = (chat_logprobs(ctx.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
                if body.logprobs else None)
    return JSONResponse(chat_response(gen.header, out, openai_message(shaper.message),
                                      shaper.finish_reason(out.finish_reason), logprobs, body.return_token_ids))


async def start_chat(ctx: ServingContext, body: ChatCompletionRequest, start_s: float,
                     id_prefix: str) -> tuple[Generation, ChatShaper]:
    """Validate a chat request, submit it, and return its generation and the shaper of its output."""
    ctx.check_model(body.model)
    body.token_ids_in_vocab(ctx.vocab_size)
    body.check_tools()
    params = body.to_sampling_params(context_fill_tokens=ctx.max_model_len)
    kwargs = body.template_kwargs()
    if ctx.tool_call_parser == "none" and body.forced_function() is not None:
        raise APIError(400, "tool_choice naming a function needs a tool-call parser (this server runs with "
                            "--tool-call-parser none)", param="tool_choice", code="unsupported_value")
    tools = ({t.function.name: t.function.parameters or {} for t in body.tools}
             if body.tools and body.tool_choice != "none" else None)
    plan = plan_chat(ctx.tokenizer, ctx.reasoning_parser, ctx.tool_call_parser, kwargs, tools,
                     body.forced_function(), body.parallel_tool_calls)
    if plan.generation_prefix:
        kwargs = {**kwargs, "generation_prefix": plan.generation_prefix}
    sub = Submission(_new_id(id_prefix), params, messages=body.template_messages(), template_kwargs=kwargs,
                     fit_max_tokens=body.requested_max_tokens is None)
    return await _start(ctx, sub, start_s), ChatShaper(plan)


async def _chat_events(gen: Generation, body: ChatCompletionRequest, shaper: ChatShaper) -> AsyncIterator[str]:
    yield sse(chat_chunk(gen.header, {"role": "assistant", "content": ""}))
    last, num_calls = None, 0
    try:
        async for out in gen.outputs():
            last = out
            delta = shaper.feed(out.delta_text, final=out.finished)
            deltas = openai_deltas(delta, num_calls)
            num_calls += len(delta.calls)
            for chunk in _chat_chunks(gen, body, out, deltas, shaper.finish_reason(out.finish_reason)):
                yield sse(chunk)
    except Exception as e:
        yield sse(from_exception(e).body())
    else:
        if body.include_usage and last is not None:
            yield sse(usage_chunk(gen.header, "chat.completion.chunk", last))
    yield DONE_EVENT


def _chat_chunks(gen: Generation, body: ChatCompletionRequest, out: RequestOutput, deltas: list[dict],
                 finish_reason: str | None) -> list[dict]:
    """The chunks for one engine output: its deltas, the first carrying the logprobs and token ids of
    the output's tokens (in an empty delta if the text is held back), then the finish chunk."""
    span = _delta_slice(out)
    logprobs = (chat_logprobs(gen.ctx.tokenizer, out.delta_token_ids, out.logprobs[span], out.top_logprobs[span])
                if body.logprobs and out.delta_token_ids else None)
    extra = {"token_ids": out.delta_token_ids} if body.return_token_ids and out.delta_token_ids else {}
    if (logprobs or extra) and not deltas:
        deltas = [{}]
    chunks = [chat_chunk(gen.header, d, None, logprobs if i == 0 else None, **(extra if i == 0 else {}))
              for i, d in enumerate(deltas)]
    if out.finished:
        finish_extra = {"prompt_token_ids": out.prompt_token_ids} if body.return_token_ids else {}
        chunks.append(chat_chunk(gen.header, {}, finish_reason, None, **finish_extra))
    return chunks


# ---- /v1/completions ----------------------------------------------------------------------------

async def completions(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    start_s = time.monotonic()
    ctx.check_model(body.model)
    body.token_ids_in_vocab(ctx.vocab_size)
    params = body.to_sampling_params()
    prompt = body.engine_prompt()
    sub = Submission(_new_id("cmpl"), params, prompt=prompt, message_starts=body.checked_message_starts(prompt))
    gen = await _start(ctx, sub, start_s)
    if body.stream:
        return SSEResponse(_completion_events(gen, body), gen.close)
    out = await gen.last_output(request)
    logprobs = (completion_logprobs(ctx.tokenizer, out.token_ids, out.logprobs, out.top_logprobs, 0)
                if body.logprobs is not None else None)
    return JSONResponse(completion_response(gen.header, out, logprobs, body.return_token_ids))


async def _completion_events(gen: Generation, body: CompletionRequest) -> AsyncIterator[str]:
    last, offset_chars = None, 0
    try:
        async for out in gen.outputs():
            last = out
            logprobs = None
            if body.logprobs is not None and out.delta_token_ids:
                span = _delta_slice(out)
                logprobs = completion_logprobs(gen.ctx.tokenizer, out.delta_token_ids, out.logprobs[span],
                                               out.top_logprobs[span], offset_chars)
                offset_chars += sum(len(t) for t in logprobs["tokens"])
            extra = {"token_ids": out.delta_token_ids} if body.return_token_ids and out.delta_token_ids else {}
            if out.finished and body.return_token_ids:
                extra["prompt_token_ids"] = out.prompt_token_ids
            if out.delta_text or logprobs or out.finished or extra:
                yield sse(completion_chunk(gen.header, out.delta_text, out.finish_reason if out.finished else None,
                                           logprobs, **extra))
    except Exception as e:
        yield sse(from_exception(e).body())
    else:
        if body.include_usage and last is not None:
            yield sse(usage_chunk(gen.header, "text_completion", last))
    yield DONE_EVENT
