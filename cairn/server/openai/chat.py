"""POST /v1/chat/completions: check a validated chat request and make its Submission and output plan
(`prepare_chat`: pure, so a request worker process runs it too, see `prepare`; Anthropic's Messages and the
Responses API are prepared through it as the equivalent chat), submit it, answer whole or as SSE chunks.

The chat's text is shaped by `chat.output` (reasoning, content, tool calls); the bodies and chunks are
`response_bodies`'. Streamed: one chunk event per engine output, `data: [DONE]` at the end; an error after the
stream started is sent as a last `data: {"error": ...}` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cairn.engine.outputs import Completion, RequestOutput
from cairn.errors import RequestTooLarge
from cairn.request.prompt import CACHE_MARKS
from cairn.server.chat.output import ChatPlan, ChatShaper, Constraints, openai_deltas, openai_message, plan_chat
from cairn.server.chat.schema import NamedToolChoice, part_cache_marks
from cairn.server.engine_io.bridge import Submission
from cairn.server.errors import APIError, from_exception, naming_max_tokens
from cairn.server.openai.protocol import ChatCompletionRequest
from cairn.server.openai.response_bodies import (
    DONE_EVENT,
    chat_chunk,
    chat_logprobs,
    chat_response,
    choices_usage_chunk,
    indexed,
    sse,
    with_choices,
)
from cairn.server.serving import Generation, ServingContext, SSEResponse, start_generation


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
    return JSONResponse(with_choices([_chat_body(gen, body, ChatShaper(shaper.plan), out) for out in outs], outs))


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
    marks = part_cache_marks(body.messages)
    if marks:  # located where the prompt is rendered (cairn.request.prompt.tokenize_prompt)
        kwargs = {**kwargs, CACHE_MARKS: marks}
    sub = Submission(request_id, params, messages=body.template_messages(), template_kwargs=kwargs,
                     fit_max_tokens=body.requested_max_tokens is None)
    return sub, plan


async def _chat_events(gen: Generation, body: ChatCompletionRequest, shaper: ChatShaper) -> AsyncIterator[str]:
    n = gen.num_choices
    shapers = [shaper] + [ChatShaper(shaper.plan) for _ in range(n - 1)]
    for index in range(n):
        yield sse(indexed(chat_chunk(gen.header, {"role": "assistant", "content": ""}), index))
    finals: dict[int, Completion] = {}
    num_calls = [0] * n
    try:
        async for out in gen.outputs():
            choice = shapers[out.index]
            delta = choice.feed(out.delta_text, final=out.finished)
            deltas = openai_deltas(delta, num_calls[out.index])
            num_calls[out.index] += len(delta.calls)
            for chunk in _chat_chunks(gen, body, out, deltas, choice.finish_reason(out.finish_reason)):
                yield sse(indexed(chunk, out.index))
            if out.finished:
                finals[out.index] = gen.answer(out.index)
    except Exception as e:
        yield sse(from_exception(e).body())
    else:
        if body.include_usage and finals:
            yield sse(choices_usage_chunk(gen.header, "chat.completion.chunk", list(finals.values())))
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
