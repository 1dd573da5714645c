"""Serving one generation: what the endpoints need from the app (`ServingContext`), a prepared request submitted to
the engine bridge (`start_generation`), its outputs gathered or streamed (`Generation`) and the SSE response that
aborts it however the stream ends (`SSEResponse`). Every API's endpoint (`openai.chat`, `openai.completions`,
`openai.responses.output`, `anthropic.messages`) answers through these.

A request is submitted before any response byte is sent, so every error add_request raises becomes
a 4xx JSON error with the right status. After that:
- non-streamed: outputs are gathered while watching for the client to go away (then the request is
  aborted and its memory freed);
- each engine output carries what one step added; `Generation` accumulates each choice's whole
  answer (`Completion`) for the response body, the usage and the finish of a stream;
- streamed: one SSE event per engine output, the API's end event last; an error after the stream
  started (engine failure, shutdown) is sent as a last error event. However the
  stream ends (finished, client gone, cancelled at shutdown), the request is aborted if unfinished.

Token timing (TTFT, inter-token latency) and token counters are recorded here, as the client sees them.
What this is not: any API's request or response shapes, or the routes (`app`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from cairn.engine.outputs import Completion, RequestOutput, accumulate
from cairn.request.tokenizer import Tokenizer
from cairn.server.engine_io.bridge import EngineBridge, RequestStream, Submission
from cairn.server.errors import APIError, EngineFailure, ServerShuttingDown, model_not_found
from cairn.server.http.middleware import current_request_id
from cairn.server.metrics import ServerMetrics


@dataclass
class ServingContext:
    """What the endpoints need from the app. The request workers get a copy without bridge and metrics."""

    bridge: EngineBridge
    metrics: ServerMetrics
    tokenizer: Tokenizer  # token_bytes() for logprobs; the chat plan reads the template (pure, thread-safe)
    served_model: str  # the name clients send and responses carry
    model_aliases: frozenset[str]  # other names accepted for the same model
    max_model_len: int
    vocab_size: int = 1 << 62  # token ids in requests must be below this
    reasoning_parser: str = "qwen3"  # "qwen3": <think> text becomes reasoning_content; "none": all content
    tool_call_parser: str = "qwen3"  # "qwen3": <tool_call> blocks become tool_calls; "none": all content
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json values for omitted fields

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model and name not in self.model_aliases:
            raise model_not_found(name)


@dataclass(frozen=True)
class ResponseHeader:
    """What every response and chunk of one request repeats."""

    id: str
    created: int  # unix seconds
    model: str

    def model_dump(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}


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
    """One submitted request: its stream, timing and metrics, and each choice's answer so far."""

    def __init__(self, ctx: ServingContext, stream: RequestStream, header: ResponseHeader, start_s: float,
                 num_choices: int = 1):
        self.ctx, self.stream, self.header, self.start_s = ctx, stream, header, start_s
        self.num_choices = num_choices  # the request's n: its outputs carry index 0 .. n - 1
        self._last_token_s: float | None = None
        self._answers: dict[tuple[str, int], Completion] = {}  # (request id, index) -> the choice's answer

    def answer(self, index: int) -> Completion:
        """Choice `index`'s answer accumulated from the outputs yielded so far."""
        return self._answers[(self.stream.request_id, index)]

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs (what each step added), recording TTFT / inter-token latency and, at the
        end, its token counts; `answer(out.index)` holds the choice's whole answer up to `out`."""
        metrics, is_first = self.ctx.metrics, True
        async for out in self._counting_failures():
            accumulate(self._answers, out)
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

    async def final_outputs(self, request: Request) -> list[Completion]:
        """The finished answer of every choice, by index; if the client disconnects first, abort and
        raise a 499."""
        gather = asyncio.ensure_future(self._finals())
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

    async def _finals(self) -> list[Completion]:
        finished: set[int] = set()
        async for out in self.outputs():
            if out.finished:
                finished.add(out.index)
        return [self.answer(i) for i in sorted(finished)]


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone: the body has been read whole, so the next ASGI message is the
    disconnect (bytes a client sends after a body are never handed on: see `http.connections`)."""
    await request.receive()


async def start_generation(ctx: ServingContext, sub: Submission, start_s: float) -> Generation:
    """Submit a prepared request to the engine bridge (which tokenizes it unless a worker did)."""
    stream = await ctx.bridge.submit(sub)
    header = ResponseHeader(id=sub.request_id, created=int(time.time()), model=ctx.served_model)
    return Generation(ctx, stream, header, start_s, sub.params.n)


def new_request_id(prefix: str) -> str:
    """A unique request id; it holds the client's X-Request-Id when one was sent, for the logs."""
    client_id = current_request_id()
    return f"{prefix}-{client_id}-{uuid.uuid4().hex[:8]}" if client_id else f"{prefix}-{uuid.uuid4().hex}"
