"""POST /v1/completions: check a validated completion request (a text or token-id prompt) and make its
Submission (`prepare_completion`: pure, so a request worker process runs it too, see `prepare`), submit it,
answer whole or as SSE chunks (`response_bodies`), `data: [DONE]` at the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cairn.engine.outputs import Completion
from cairn.server.engine_io.bridge import Submission
from cairn.server.errors import from_exception
from cairn.server.openai.protocol import CompletionRequest
from cairn.server.openai.response_bodies import (
    DONE_EVENT,
    TextOffsets,
    choices_usage_chunk,
    completion_chunk,
    completion_logprobs,
    completion_response,
    indexed,
    sse,
    with_choices,
)
from cairn.server.serving import Generation, ServingContext, SSEResponse, start_generation


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
    return JSONResponse(with_choices(bodies, outs))


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
                yield sse(indexed(chunk, out.index))
            if out.finished:
                finals[out.index] = gen.answer(out.index)
    except Exception as e:
        yield sse(from_exception(e).body())
    else:
        if body.include_usage and finals:
            yield sse(choices_usage_chunk(gen.header, "text_completion", list(finals.values())))
    yield DONE_EVENT
