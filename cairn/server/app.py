"""The FastAPI app: routes, error handlers, middlewares and the engine thread's lifespan.

    POST /v1/chat/completions   chat, whole or streamed (SSE)
    POST /v1/completions        text or token-id prompt, whole or streamed (SSE)
    POST /v1/messages           Anthropic Messages API, whole or streamed (see `anthropic.messages`)
    POST /v1/messages/count_tokens  the prompt tokens of such a request (see `anthropic.messages`)
    POST /v1/responses          OpenAI's Responses API, whole or streamed (see `openai.responses`);
                                GET / DELETE /v1/responses/{id}: a stored response
    POST /tokenize, /detokenize text or chat messages to token ids and back (see `tokenize`)
    GET  /v1/models             the served model; GET /v1/models/{name} one model or 404
    GET  /health                liveness: 200 while the engine can make progress, else 503 (never needs the API
                                key; answered on a connection over --max-connections too: busy is alive)
    GET  /ready                 readiness: 200 when a request sent now would be taken, else 503 (the engine
                                cannot make progress, the server is shutting down, or the connection cap is reached)
    GET  /metrics               Prometheus text (this app's own registry; see `metrics`)
    POST /v1/cache/probe        where a request would resume here, and the queue (see `probe`; for `cairn router`);
                                /v1/cache/probe/messages, /v1/cache/probe/responses: the same for an
                                Anthropic Messages body, a Responses body

POST bodies must be sent as JSON (Content-Type application/json or application/*+json, else 415). With
--api-key every route but /health and /ready (and /metrics with --metrics-public) needs `Authorization:
Bearer <key>` or `x-api-key: <key>`; --allowed-origins turns CORS on; a client's X-Request-Id is
echoed and shows in the request's id (`chatcmpl-<X-Request-Id>-<random>`) and log lines.

`create_app(engine, options)` takes an already built Engine and starts no thread itself: the
lifespan starts the engine thread and stops it (aborting what is left) at shutdown. Every error is
OpenAI-shaped (see `errors`). What this is not: the process, its signals and uvicorn (`main`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from cairn.engine.engine import Engine
from cairn.server import probe, tokenize
from cairn.server.anthropic import messages as anthropic
from cairn.server.engine_io.bridge import EngineBridge
from cairn.server.engine_io.offload import Offload
from cairn.server.errors import APIError, from_exception, from_validation_errors
from cairn.server.http.middleware import (
    OVER_CAP,
    APIKeyAuth,
    BodySizeLimit,
    ConnectionCap,
    JSONBodiesOnly,
    RequestCounter,
    RequestId,
    cache_salt,
    current_request_id,
)
from cairn.server.metrics import EngineStats, ServerMetrics
from cairn.server.openai.chat import chat_completions
from cairn.server.openai.completions import completions
from cairn.server.openai.response_bodies import model_list
from cairn.server.openai.responses import output as responses_output
from cairn.server.openai.responses.output import ResponseStore
from cairn.server.options import MIB, ServerOptions
from cairn.server.prepare import JSON_ERRORS, Prepared, invalid_json, parse_body, prepare, prepare_response
from cairn.server.serving import ServingContext, new_request_id

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/responses", "/tokenize", "/detokenize", "/v1/models", "/health", "/ready", "/metrics", probe.PATH,
             probe.MESSAGES_PATH, probe.RESPONSES_PATH)
ENGINE_STOP_TIMEOUT_S = 5.0  # at lifespan shutdown, how long to wait for the engine thread before saying so
STATS_TIMEOUT_S = 5.0  # how long /metrics waits for the engine thread between two steps


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def guarded(handler: Awaitable[Response], prompt_param: str) -> Response:
    """Await a handler; any exception but RequestValidationError (which FastAPI's handler answers)
    becomes an OpenAI-shaped error response (see log_error)."""
    try:
        return await handler
    except RequestValidationError:
        raise
    except Exception as e:
        error = from_exception(e, prompt_param)
        log_error(error, e)
        return error_response(error)


def shaped_error(request: Request, e: APIError) -> JSONResponse:
    """The error in the shape of the API the request was for (Anthropic's on /v1/messages)."""
    return JSONResponse(e.body_for(request.url.path), status_code=e.status, headers=e.headers)


def log_error(error: APIError, e: Exception) -> None:
    """One line for a client gone (499) or a refusal while shutting down (503); a traceback for any
    other 5xx (a bug or an engine failure); nothing for the other 4xx (the client's mistake)."""
    who = f"request {current_request_id()}" if current_request_id() else "request"
    if error.status == 499:
        log.info("%s: the client closed the connection before the response; the request was aborted", who)
    elif error.code == "shutting_down":
        log.warning("%s refused: %s", who, error.message)
    elif error.status >= 500:
        log.error("%s failed: %s", who, error.message, exc_info=e)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return shaped_error(request, from_validation_errors(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return shaped_error(request, APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return shaped_error(request, exc)


def model_card(ctx: ServingContext, created_s: int) -> dict:
    """The served model as OpenAI's clients (id, object, created, owned_by) and Anthropic's (type,
    display_name, created_at, lifecycle) read a model; `created` is when this server started."""
    created_at = datetime.datetime.fromtimestamp(created_s, datetime.UTC).isoformat().replace("+00:00", "Z")
    return {"id": ctx.served_model, "object": "model", "created": created_s, "owned_by": "cairn",
            "max_model_len": ctx.max_model_len, "type": "model", "display_name": ctx.served_model,
            "created_at": created_at, "lifecycle": "active"}


async def body_chunks(request: Request) -> list[bytes]:
    """The request body as the chunks it arrived in (never joined here: see `prepare`)."""
    return [chunk async for chunk in request.stream() if chunk]


async def read_body(request: Request, model: type[M], offload: Offload) -> M:
    """The JSON body validated as `model`, raising what FastAPI would (RequestValidationError). Parsed
    here rather than by FastAPI so that a large body is parsed by an offload worker process, not on the
    event loop holding the interpreter lock the engine thread needs."""
    try:
        data = await offload.parse_json(await body_chunks(request))
    except JSON_ERRORS as e:
        raise invalid_json(e) from None
    return parse_body(model, data)


def salted(p: Prepared, request: Request) -> Prepared:
    """p, its submission's cache salt inside the request's API key tenant (--cache-isolation per-key)."""
    params = p.submission.params
    salt = cache_salt(request.scope, params.cache_salt)
    if salt == params.cache_salt:
        return p
    sub = dataclasses.replace(p.submission, params=dataclasses.replace(params, cache_salt=salt))
    return dataclasses.replace(p, submission=sub)


def add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    offload = ctx.bridge.offload

    async def chat_request(request: Request) -> Response:
        start_s = time.monotonic()
        p = await prepare(ctx, offload, await body_chunks(request), "chat", new_request_id("chatcmpl"))
        p = salted(p, request)
        return await chat_completions(ctx, p.submission, p.plan, p.body, request, start_s)

    async def completion_request(request: Request) -> Response:
        start_s = time.monotonic()
        p = salted(await prepare(ctx, offload, await body_chunks(request), "completion", new_request_id("cmpl")),
                   request)
        return await completions(ctx, p.submission, p.body, request, start_s)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await guarded(chat_request(request), "messages")

    @app.post("/v1/completions")
    async def complete(request: Request) -> Response:
        return await guarded(completion_request(request), "prompt")

    async def messages_request(request: Request) -> Response:
        start_s = time.monotonic()
        p = salted(await prepare(ctx, offload, await body_chunks(request), "messages", new_request_id("msg")), request)
        return await anthropic.messages(ctx, p.submission, p.plan, p.body, request, start_s)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await anthropic.guarded(messages_request(request))

    async def count_tokens_request(request: Request) -> Response:
        body = await read_body(request, anthropic.CountTokensRequest, offload)
        return JSONResponse(await anthropic.count_tokens(ctx, body))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await anthropic.guarded(count_tokens_request(request))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await guarded(tokenize.respond(ctx, offload, await body_chunks(request), "tokenize"), "messages")

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await guarded(tokenize.respond(ctx, offload, await body_chunks(request), "detokenize"), "tokens")


def add_responses_routes(app: FastAPI, ctx: ServingContext, store: ResponseStore) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id} (see `openai.responses.output`)."""
    async def create_request(request: Request) -> Response:
        start_s = time.monotonic()
        p, prior = await prepare_response(ctx, await body_chunks(request), store)
        p = salted(p, request)
        return await responses_output.create(ctx, store, p.submission, p.plan, p.body, prior, request, start_s)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        return await guarded(create_request(request), "input")

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        return responses_output.retrieve(store, response_id, request.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        return responses_output.delete(store, response_id)


def add_info_routes(app: FastAPI, ctx: ServingContext) -> None:
    created_s = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict:
        return model_list([model_card(ctx, created_s)])

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        try:
            ctx.check_model(name)
        except APIError as e:
            return error_response(e)
        return JSONResponse(model_card(ctx, created_s))

    @app.get("/health")
    async def health() -> Response:
        reason = ctx.bridge.unhealthy()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return error_response(APIError(503, reason, "server_error", code="unhealthy"))

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        reason = ctx.bridge.unhealthy() or ("The server is shutting down." if ctx.bridge.draining else None)
        if reason is None and request.scope.get(OVER_CAP):
            reason = "The server has as many connections open as --max-connections allows."
        if reason is None:
            return JSONResponse({"status": "ready"})
        return error_response(APIError(503, reason, "server_error", code="not_ready"))

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await asyncio.wait_for(ctx.bridge.call(EngineStats.read), STATS_TIMEOUT_S)
        except Exception:
            log.warning("engine stats unavailable for /metrics", exc_info=True)
            stats = None
        ctx.metrics.engine.update(stats, ctx.bridge.num_step_failures)
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(engine: Engine, options: ServerOptions) -> FastAPI:
    """The app serving `engine`; its engine thread runs from lifespan startup to shutdown."""
    worker_ctx = ServingContext(None, None, engine.tokenizer, options.served_model_name or engine.model_name,
                                frozenset({engine.model_name}), engine.max_model_len, engine.model_config.vocab_size,
                                options.reasoning_parser, options.tool_call_parser, engine.sampling_defaults)
    bridge = EngineBridge(engine, Offload(engine.tokenizer, engine.max_model_len, worker_ctx))
    ctx = dataclasses.replace(worker_ctx, bridge=bridge, metrics=ServerMetrics())  # (request workers get worker_ctx)
    metrics = ctx.metrics

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        bridge.start()
        bridge.offload.start()
        yield
        await asyncio.to_thread(bridge.stop, ENGINE_STOP_TIMEOUT_S)

    app = FastAPI(title="cairn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    add_generation_routes(app, ctx)
    store = ResponseStore()
    add_responses_routes(app, ctx, store)
    add_info_routes(app, ctx)
    probe.add_probe_route(app, ctx, read_body, guarded, store)
    add_middlewares(app, options, metrics)
    return app


def add_middlewares(app: FastAPI, options: ServerOptions, metrics: ServerMetrics) -> None:
    """From the outside in: request counter (counts every answer, 401s and 413s included), the connection cap's
    503 (but /health), CORS (answers preflights), X-Request-Id, API key, JSON bodies only (415), body limits (so
    an unauthorized or non-JSON body is never read), the app. (The Host check wraps the app in `main`: the
    in-process app answers any Host.)"""
    app.add_middleware(BodySizeLimit, max_bytes=options.max_request_bytes, timeout_s=options.body_timeout_s,
                       max_bytes_per_s=options.body_read_mib_per_s * MIB)
    app.add_middleware(JSONBodiesOnly)
    if options.api_keys:
        public = ("/health", "/ready", "/metrics") if options.metrics_public else ("/health", "/ready")
        app.add_middleware(APIKeyAuth, api_keys=options.api_keys, public_paths=public,
                           tenants=options.cache_isolation == "per-key")
    app.add_middleware(RequestId)
    if options.origins:
        app.add_middleware(CORSMiddleware, allow_origins=options.origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "X-Api-Key", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(ConnectionCap, max_connections=options.max_connections)
    app.add_middleware(RequestCounter, counter=metrics.requests, endpoints=ENDPOINTS)
