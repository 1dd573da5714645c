"""POST /v1/cache/probe: where this replica would resume a request, and how busy it is (for `cairn router`).

Body: the very body of a /v1/chat/completions (with "messages") or /v1/completions request; on
`/v1/cache/probe/messages` (MESSAGES_PATH), that of an Anthropic /v1/messages request; on
`/v1/cache/probe/responses` (RESPONSES_PATH), that of a /v1/responses request (its previous_response_id looked
up in this replica's store: a 404 on a replica that does not hold it). Nothing is
generated, locked, loaded or queued: the prompt is rendered and tokenized as the real request would be
(off the event loop), the remote tier (with --remote-cache) is asked what it holds of the prompt (off the
engine thread: that answer is then counted in the plan), and the cache's planner answers on the engine
thread between two steps.

    {"tokens": 1234,              prompt length in tokens
     "position": 1024,            resume position the planner would choose now (0: cold prefill)
     "tier": "host",              the tier its snapshot comes from (null when cold)
     "est_ttft_s": 0.041,         the planner's estimate of the time to the first token (null without a cache)
     "remote_position": 1024,     the deepest snapshot the remote tier (Redis) holds for it (0: none or no tier)
     "waiting": 0, "running": 2}  requests queued and running on this replica

The estimate ignores the wait behind queued requests: the router weighs `waiting` and `running` itself.
A chat request's forced generation prefix (tool_choice naming a function) is not rendered here: it only
changes the last few tokens. A body's `cache_salt` (inside the API key's tenant with --cache-isolation per-key)
names the namespace probed, as it would the request's: nothing another salt cached is counted.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from pydantic import RootModel
from starlette.responses import JSONResponse, Response

from cairn.engine.engine import Engine, check_prompt_token_ids
from cairn.request.sampling_params import SamplingParams
from cairn.server.anthropic.request import MessagesRequest
from cairn.server.engine_io.bridge import Submission
from cairn.server.http.middleware import cache_salt
from cairn.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from cairn.server.openai.responses.output import ResponseStore
from cairn.server.openai.responses.request import ResponsesRequest, previous_not_found
from cairn.server.serving import ServingContext

PATH = "/v1/cache/probe"
MESSAGES_PATH = PATH + "/messages"  # the probe of an Anthropic Messages body (its fields overlap a chat's)
RESPONSES_PATH = PATH + "/responses"  # the probe of a Responses API body


class ProbeRequest(RootModel[ChatCompletionRequest | CompletionRequest]):
    """A chat or a completion request (each model forbids the other's fields, so the body picks one)."""


def add_probe_route(app: FastAPI, ctx: ServingContext, read_body, guarded, store: ResponseStore) -> None:
    """`read_body` and `guarded` are app.py's (parse off the loop, errors in the OpenAI shape); `store`: the
    stored Responses conversations."""
    offload = ctx.bridge.offload

    @app.post(PATH)
    async def probe_route(request: Request) -> Response:
        body = (await read_body(request, ProbeRequest, offload)).root
        return await guarded(probe(ctx, body, request), "messages" if isinstance(body, ChatCompletionRequest)
                             else "prompt")

    async def probe_messages(request: Request) -> Response:
        return await probe(ctx, (await read_body(request, MessagesRequest, offload)).to_chat(), request)

    @app.post(MESSAGES_PATH)
    async def probe_messages_route(request: Request) -> Response:
        return await guarded(probe_messages(request), "messages")

    async def probe_responses(request: Request) -> Response:
        body = await read_body(request, ResponsesRequest, offload)
        prior = []
        if body.previous_response_id is not None:
            prior = store.conversation(body.previous_response_id)
            if prior is None:
                raise previous_not_found(body.previous_response_id)
        return await probe(ctx, body.to_chat(prior), request)

    @app.post(RESPONSES_PATH)
    async def probe_responses_route(request: Request) -> Response:
        return await guarded(probe_responses(request), "input")


async def probe(ctx: ServingContext, body: ChatCompletionRequest | CompletionRequest, request: Request) -> Response:
    ctx.check_model(body.model)
    sub = _submission(body, cache_salt(request.scope, body.cache_salt))
    prompt = await ctx.bridge.tokenize(sub)
    check_prompt_token_ids(prompt.token_ids, ctx.vocab_size)  # as /v1/completions would refuse them
    await ctx.bridge.prefetch(prompt, sub.params)  # the remote tier's lookup, off the engine thread
    answer = await ctx.bridge.call(lambda engine: _answer(engine, prompt.token_ids, sub.params.cache_salt))
    return JSONResponse({"tokens": len(prompt.token_ids), **answer})


def _submission(body: ChatCompletionRequest | CompletionRequest, salt: str | None) -> Submission:
    request_id, params = f"probe-{uuid.uuid4().hex[:8]}", SamplingParams(cache_salt=salt)
    if isinstance(body, ChatCompletionRequest):
        return Submission(request_id, params, messages=body.template_messages(), template_kwargs=body.prompt_kwargs())
    prompt = body.engine_prompt()
    return Submission(request_id, params, prompt=prompt, message_starts=body.checked_message_starts(prompt))


def _answer(engine: Engine, token_ids: list[int], salt: str | None) -> dict:
    """On the engine thread: the cache's plan for these tokens (under their cache salt), and the queue."""
    found = engine.probe(token_ids, salt)
    return {"position": found.position, "tier": found.tier, "est_ttft_s": found.estimated_s,
            "remote_position": found.remote_position, "waiting": engine.num_waiting, "running": engine.num_running}
