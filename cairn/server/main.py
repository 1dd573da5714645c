"""`cairn serve`: build the engine, serve the app with uvicorn, shut down cleanly on SIGTERM / SIGINT.

Shutdown, on the first SIGTERM or SIGINT:
1. uvicorn stops accepting connections; the engine bridge refuses new requests (503);
2. in-flight requests run on for up to `--shutdown-timeout-s`; then the bridge aborts what is left
   (a stream gets a last error event and `[DONE]`, a waiting non-streamed request a 503);
3. uvicorn cancels any task still running `SHUTDOWN_GRACE_S` later, the lifespan stops the engine
   thread, and the process exits with status 0. The engine thread ends after its current step, which
   can be long (a long prefill on a CPU): the lifespan waits for it, so that what the aborted requests
   computed is written to the disk and remote cache and the cache is closed.
A second signal skips the waiting: the bridge aborts every request at once, the steps above run
without delay, and the lifespan waits for a step at most `app.ENGINE_STOP_TIMEOUT_S` (the engine thread
is still stopped and the disk cache closed unless a step outlasts that). A task uvicorn has to
cancel logs one line, not a CancelledError traceback.

Connections are served by `connections.GuardedH11Protocol` (request-head deadline, connection cap). Bound to a
loopback address, the app answers only the Host names of `ServerOptions.host_names` (`middleware.HostCheck`).
Before serving, every object alive after start-up (the model, the tokenizer, the imported libraries)
is frozen out of the garbage collector's reach (`settle_heap`): a full collection otherwise walks
them all, holding the interpreter lock for 175-220 ms (demo model) in the middle of an engine step,
which every stream sees as one late token.
What this is not: the routes (`app`) or the engine thread (`bridge`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable

import uvicorn

from cairn.config import EngineConfig
from cairn.engine.engine import Engine
from cairn.server.app import create_app
from cairn.server.http.access_log import AccessLog
from cairn.server.http.connections import guarded_protocol
from cairn.server.http.middleware import HostCheck
from cairn.server.options import ServerOptions

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 2.0  # after the bridge's abort deadline, how long streams get to send their last event


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the engine at shutdown and exits 0 after a signal.

    (uvicorn itself re-raises the signal once it has shut down, ending the process with -SIGTERM, and
    on a second SIGINT skips the app's shutdown, leaving the engine thread running.)
    """

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], None], drain_timeout_s: float,
                 hurry: Callable[[], None]):
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = drain_timeout_s
        self._hurry = hurry

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            log.info("signal %d again: aborting every request now", sig)
            # A signal handler runs between two bytecodes of the main thread, which may hold a lock drain()
            # takes (the bridge's, a queue's): drain on the event loop, as its next callback.
            try:
                asyncio.get_running_loop().call_soon_threadsafe(self._abort_now)
            except RuntimeError:  # no loop running (yet, or any more)
                self._abort_now()
            return
        self.should_exit = True
        log.info("signal %d: shutting down", sig)

    def _abort_now(self) -> None:
        self._hurry()
        self._drain(0.0)

    async def shutdown(self, sockets=None) -> None:
        self._drain(self._drain_timeout_s)
        await super().shutdown(sockets)


class QuietCancellation:
    """Outermost ASGI wrapper: a request task uvicorn cancels at shutdown ends with one log line
    instead of uvicorn's 'Exception in ASGI application' CancelledError traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            log.warning("%s %s cancelled at shutdown", scope.get("method", ""), scope.get("path", ""))


def settle_heap() -> int:
    """Collect start-up garbage, then freeze what is left (gc.freeze) so that later collections never
    scan it; returns the number of objects frozen (counting them walks the frozen list: do it once).
    Those objects live as long as the process anyway; what the server allocates afterwards is
    collected as usual."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(engine_config: EngineConfig, options: ServerOptions) -> int:
    """Serve until SIGTERM / SIGINT; returns the process exit status."""
    engine = Engine(engine_config)
    app = create_app(engine, options)
    bridge = app.state.ctx.bridge
    served = app if options.host_names is None else HostCheck(app, options.host_names)
    protocol = guarded_protocol(options.header_timeout_s, options.max_connections, probes_over_cap=True)
    config = uvicorn.Config(QuietCancellation(AccessLog(served) if options.access_log else served), host=options.host,
                            port=options.port, log_config=None, access_log=False, lifespan="on", http=protocol,
                            timeout_graceful_shutdown=options.shutdown_timeout_s + SHUTDOWN_GRACE_S)
    server = GracefulServer(config, bridge.drain, options.shutdown_timeout_s, bridge.hurry)
    app.state.ctx.metrics.gc.num_frozen_objects = settle_heap()
    log.info("serving %s (context %d tokens) on http://%s:%d", app.state.ctx.served_model, engine.max_model_len,
             options.host, options.port)
    server.run()
    return 0 if server.started else 1
