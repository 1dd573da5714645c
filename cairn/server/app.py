"""The FastAPI app: routes, error handlers, middlewares and the engine thread's lifespan.

    POST /v1/chat/completions   chat, whole or streamed (SSE)
    POST /v1/completions        text or token-id prompt, whole or streamed (SSE)
    GET  /v1/models             the served model; GET /v1/models/{name} one model or 404
    GET  /health                200 while the engine thread is alive, else 503
    GET  /metrics               Prometheus text (this app's own registry; see `metrics`)

`create_app(engine, options)` takes an already built Engine and starts no thread itself: the
lifespan starts the engine thread and stops it (aborting what is left) at shutdown. Every error is
OpenAI-shaped (see `errors`). What this is not: the process, its signals and uvicorn (`main`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from cairn.engine import Engine
from cairn.server import generate
from cairn.server.bridge import EngineBridge
from cairn.server.errors import APIError, from_exception, from_validation_errors
from cairn.server.generate import ServingContext
from cairn.server.metrics import EngineStats, ServerMetrics
from cairn.server.middleware import BodySizeLimit, RequestCounter
from cairn.server.options import ServerOptions
from cairn.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
ENGINE_STOP_TIMEOUT_S = 5.0  # at lifespan shutdown, how long to wait for the engine thread to end
STATS_TIMEOUT_S = 5.0  # how long /metrics waits for the engine thread between two steps


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def guarded(handler: Awaitable[Response], prompt_param: str) -> Response:
    """Await a handler; any exception becomes an OpenAI-shaped error response (5xx are logged)."""
    try:
        return await handler
    except Exception as e:
        error = from_exception(e, prompt_param)
        if error.status >= 500:
            log.exception("request failed: %s", error.message)
        return error_response(error)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_errors(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)


def model_card(ctx: ServingContext, created_s: int) -> dict:
    return {"id": ctx.served_model, "object": "model", "created": created_s, "owned_by": "cairn",
            "max_model_len": ctx.max_model_len}


def add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await guarded(generate.chat_completions(ctx, body, request), "messages")

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request) -> Response:
        return await guarded(generate.completions(ctx, body, request), "prompt")


def add_info_routes(app: FastAPI, ctx: ServingContext) -> None:
    created_s = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(ctx, created_s)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        try:
            ctx.check_model(name)
        except APIError as e:
            return error_response(e)
        return JSONResponse(model_card(ctx, created_s))

    @app.get("/health")
    async def health() -> Response:
        if ctx.bridge.alive:
            return JSONResponse({"status": "ok"})
        return error_response(APIError(503, "The engine thread is not running.", "server_error", code="unhealthy"))

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
    bridge = EngineBridge(engine)
    metrics = ServerMetrics()
    ctx = ServingContext(bridge, metrics, engine.tokenizer, options.served_model_name or engine.model_name,
                         frozenset({engine.model_name}), engine.max_model_len, engine.sampling_defaults)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        bridge.start()
        yield
        await asyncio.to_thread(bridge.stop, ENGINE_STOP_TIMEOUT_S)

    app = FastAPI(title="cairn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    add_generation_routes(app, ctx)
    add_info_routes(app, ctx)
    app.add_middleware(BodySizeLimit, max_bytes=options.max_request_bytes)
    app.add_middleware(RequestCounter, counter=metrics.requests, endpoints=ENDPOINTS)  # outermost: counts 413s
    return app
