"""The generation endpoints: check a validated request and make its Submission (`prepare_chat`,
`prepare_completion`: pure, so a request worker process runs them too, see `prepare`), submit it to
the engine bridge, answer whole or as an SSE stream.

A request is submitted before any response byte is sent, so every error add_request raises becomes
a 4xx JSON error with the right status. After that:
- non-streamed: outputs are gathered while watching for the client to go away (then the request is
  aborted and its memory freed);
- each engine output carries what one step added; `Generation` accumulates each choice's whole
  answer (`Completion`) for the response body, the usage and the finish of a stream;
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
from dataclasses import dataclass, field, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cairn.engine.outputs import Completion, RequestOutput, accumulate
from cairn.errors import RequestTooLarge
from cairn.request.tokenizer import Tokenizer
from cairn.server.bridge import EngineBridge, RequestStream, Submission
from cairn.server.chat_output import ChatPlan, ChatShaper, Constraints, openai_deltas, openai_message, plan_chat
from cairn.server.chat_schema import NamedToolChoice
from cairn.server.errors import (
    APIError,
    EngineFailure,
    ServerShuttingDown,
    from_exception,
    model_not_found,
    naming_max_tokens,
)
from cairn.server.metrics import ServerMetrics
from cairn.server.middleware import current_request_id
from cairn.server.protocol import ChatCompletionRequest, CompletionRequest
from cairn.server.responses import (
    DONE_EVENT,
    ResponseHeader,
    TextOffsets,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    usage_chunk,
)


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
    disconnect (bytes a client sends after a body are never handed on: see `connections`)."""
    await request.receive()


def _with_choices(bodies: list[dict], outs: list[Completion]) -> dict:
    """One response holding every choice of an n > 1 request: each body's choice with its index, the
    usage counting every choice's tokens (the prompt once)."""
    body = bodies[0]
    body["choices"] = [{**b["choices"][0], "index": out.index} for b, out in zip(bodies, outs, strict=True)]
    if body.get("usage"):
        _count_all_choices(body["usage"], outs)
    return body


def _count_all_choices(usage: dict, outs: list[Completion]) -> None:
    usage["completion_tokens"] = sum(len(o.token_ids) for o in outs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def _indexed(chunk: dict, index: int) -> dict:
    """A one-choice stream chunk for choice `index` of the request."""
    chunk["choices"][0]["index"] = index
    return chunk


async def start_generation(ctx: ServingContext, sub: Submission, start_s: float) -> Generation:
    """Submit a prepared request to the engine bridge (which tokenizes it unless a worker did)."""
    stream = await ctx.bridge.submit(sub)
    header = ResponseHeader(id=sub.request_id, created=int(time.time()), model=ctx.served_model)
    return Generation(ctx, stream, header, start_s, sub.params.n)


def new_request_id(prefix: str) -> str:
    """A unique request id; it holds the client's X-Request-Id when one was sent, for the logs."""
    client_id = current_request_id()
    return f"{prefix}-{client_id}-{uuid.uuid4().hex[:8]}" if client_id else f"{prefix}-{uuid.uuid4().hex}"


# ---- /v1/chat/completions -----------------------------------------------------------------------

async def chat_completions(ctx: ServingContext, sub: Submission, plan: ChatPlan, body: ChatCompletionRequest,
                           request: Request, start_s: float) -> Response:
    """A chat prepared by `prepare_chat` (`body`: its sampling and output fields), answered whole or streamed."""
    try:
        gen, shaper = await start_generation(ctx, sub, start_s), ChatShaper(plan)
    except RequestTooLarge as e:  # the prompt and the output limit do not fit: name the limit as it was sent
        raise naming_max_tokens(from_exception(e), body.max_tokens_field) from None
    if body.stream:
        return SSEResponse(_chat_events(gen, body, shaper), gen.close)
    outs = await gen.final_outputs(request)
    return JSONResponse(_with_choices([_chat_body(gen, body, ChatShaper(shaper.plan), out) for out in outs], outs))


def _chat_body(gen: Generation, body: ChatCompletionRequest, shaper: ChatShaper, out: Completion) -> dict:
    """The response body of one finished choice, its text split by the chat parsers."""
    shaper.feed(out.text, final=True)
    logprobs = (chat_logprobs(gen.ctx.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
                if body.logprobs else None)
    return chat_response(gen.header, out, openai_message(shaper.message), shaper.finish_reason(out.finish_reason),
                         logprobs, body.return_token_ids)


def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest, request_id: str) -> tuple[Submission, ChatPlan]:
    """Check a chat request and make its submission (messages, not yet tokenized) and output plan.
    Uses neither ctx.bridge nor ctx.metrics: it also runs in a request worker process (see `prepare`)."""
    ctx.check_model(body.model)
    body.token_ids_in_vocab(ctx.vocab_size)
    body.check_tools()
    body.check_continuation()
    params = body.to_sampling_params(context_fill_tokens=ctx.max_model_len, defaults=ctx.sampling_defaults)
    kwargs = body.template_kwargs()
    forced = body.forced_tools()
    if ctx.tool_call_parser == "none" and forced is not None:
        raise APIError(400, "a tool_choice that forces a call needs a tool-call parser (this server runs with "
                            "--tool-call-parser none)", param="tool_choice", code="unsupported_value")
    tools = ({t.function.name: t.function.parameters or {} for t in body.tools}
             if body.tools and body.tool_choice != "none" else None)
    constraints = Constraints(forced, isinstance(body.tool_choice, NamedToolChoice), body.strict_tools(),
                              params.structured, body.thinking_token_budget, body.continue_final_message)
    plan = plan_chat(ctx.tokenizer, ctx.reasoning_parser, ctx.tool_call_parser, kwargs, tools,
                     body.parallel_tool_calls, constraints)
    params = replace(params, structured=plan.structured, keep_special_tokens=plan.markers)
    kwargs = body.prompt_kwargs()
    if plan.generation_prefix:
        kwargs = {**kwargs, "generation_prefix": plan.generation_prefix}
    sub = Submission(request_id, params, messages=body.template_messages(), template_kwargs=kwargs,
                     fit_max_tokens=body.requested_max_tokens is None)
    return sub, plan


async def _chat_events(gen: Generation, body: ChatCompletionRequest, shaper: ChatShaper) -> AsyncIterator[str]:
    n = gen.num_choices
    shapers = [shaper] + [ChatShaper(shaper.plan) for _ in range(n - 1)]
    for index in range(n):
        yield sse(_indexed(chat_chunk(gen.header, {"role": "assistant", "content": ""}), index))
    finals: dict[int, Completion] = {}
    num_calls = [0] * n
    try:
        async for out in gen.outputs():
            choice = shapers[out.index]
            delta = choice.feed(out.delta_text, final=out.finished)
            deltas = openai_deltas(delta, num_calls[out.index])
            num_calls[out.index] += len(delta.calls)
            for chunk in _chat_chunks(gen, body, out, deltas, choice.finish_reason(out.finish_reason)):
                yield sse(_indexed(chunk, out.index))
            if out.finished:
                finals[out.index] = gen.answer(out.index)
    except Exception as e:
        yield sse(from_exception(e).body())
    else:
        if body.include_usage and finals:
            yield sse(_usage_chunk(gen.header, "chat.completion.chunk", list(finals.values())))
    yield DONE_EVENT


def _chat_chunks(gen: Generation, body: ChatCompletionRequest, out: RequestOutput, deltas: list[dict],
                 finish_reason: str | None) -> list[dict]:
    """The chunks for one engine output: its deltas, the first carrying the logprobs and token ids of
    the output's tokens (in an empty delta if the text is held back), then the finish chunk."""
    logprobs = (chat_logprobs(gen.ctx.tokenizer, out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs)
                if body.logprobs and out.delta_token_ids else None)
    extra = {"token_ids": out.delta_token_ids} if body.return_token_ids and out.delta_token_ids else {}
    if (logprobs or extra) and not deltas:
        deltas = [{}]
    chunks = [chat_chunk(gen.header, d, None, logprobs if i == 0 else None, **(extra if i == 0 else {}))
              for i, d in enumerate(deltas)]
    if out.finished:
        chunks.append(chat_chunk(gen.header, {}, finish_reason, None))
        if body.return_token_ids:  # beside the choices, as in the whole response (vLLM's chunk field)
            chunks[-1]["prompt_token_ids"] = out.prompt_token_ids
    return chunks


def _usage_chunk(header: ResponseHeader, obj: str, finals: list[Completion]) -> dict:
    chunk = usage_chunk(header, obj, finals[0])
    _count_all_choices(chunk["usage"], finals)
    return chunk


# ---- /v1/completions ----------------------------------------------------------------------------

def prepare_completion(ctx: ServingContext, body: CompletionRequest, request_id: str) -> Submission:
    """Check a completion request and make its submission (not yet tokenized). Uses neither ctx.bridge
    nor ctx.metrics: it also runs in a request worker process (see `prepare`)."""
    ctx.check_model(body.model)
    body.token_ids_in_vocab(ctx.vocab_size)
    params = body.to_sampling_params(defaults=ctx.sampling_defaults)
    prompt = body.engine_prompt()
    return Submission(request_id, params, prompt=prompt, message_starts=body.checked_message_starts(prompt))


async def completions(ctx: ServingContext, sub: Submission, body: CompletionRequest, request: Request,
                      start_s: float) -> Response:
    """A completion prepared by `prepare_completion` (`body`: its sampling and output fields)."""
    gen = await start_generation(ctx, sub, start_s)
    if body.stream:
        return SSEResponse(_completion_events(gen, body), gen.close)
    outs = await gen.final_outputs(request)
    bodies = [completion_response(gen.header, out, completion_logprobs(
        ctx.tokenizer, out.token_ids, out.logprobs, out.top_logprobs, _text_offsets(ctx, body))
        if body.logprobs is not None else None, body.return_token_ids) for out in outs]
    return JSONResponse(_with_choices(bodies, outs))


def _text_offsets(ctx: ServingContext, body: CompletionRequest) -> TextOffsets:
    """logprobs.text_offset of one answer: offsets in its text, where skip_special_tokens leaves special tokens'
    text out (their tokens, and their text in logprobs.tokens, stay)."""
    return TextOffsets(frozenset(ctx.tokenizer.special_tokens.values()) if body.skip_special_tokens else frozenset())


async def _completion_events(gen: Generation, body: CompletionRequest) -> AsyncIterator[str]:
    finals: dict[int, Completion] = {}
    offsets: dict[int, TextOffsets] = {}  # per choice
    try:
        async for out in gen.outputs():
            logprobs = None
            if body.logprobs is not None and out.delta_token_ids:
                if out.index not in offsets:
                    offsets[out.index] = _text_offsets(gen.ctx, body)
                logprobs = completion_logprobs(gen.ctx.tokenizer, out.delta_token_ids, out.delta_logprobs,
                                               out.delta_top_logprobs, offsets[out.index])
            extra = {"token_ids": out.delta_token_ids} if body.return_token_ids and out.delta_token_ids else {}
            if out.finished and body.return_token_ids:
                extra["prompt_token_ids"] = out.prompt_token_ids
            if out.delta_text or logprobs or out.finished or extra:
                chunk = completion_chunk(gen.header, out.delta_text, out.finish_reason if out.finished else None,
                                         logprobs, **extra)
                yield sse(_indexed(chunk, out.index))
            if out.finished:
                finals[out.index] = gen.answer(out.index)
    except Exception as e:
        yield sse(from_exception(e).body())
    else:
        if body.include_usage and finals:
            yield sse(_usage_chunk(gen.header, "text_completion", list(finals.values())))
    yield DONE_EVENT
