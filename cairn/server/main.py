"""`cairn serve`: build the engine, serve the app with uvicorn, shut down cleanly on SIGTERM / SIGINT.

Shutdown, on the first SIGTERM or SIGINT:
1. uvicorn stops accepting connections; the engine bridge refuses new requests (503);
2. in-flight requests run on for up to `--shutdown-timeout-s`; then the bridge aborts what is left
   (a stream gets a last error event and `[DONE]`, a waiting non-streamed request a 503);
3. uvicorn cancels any task still running `SHUTDOWN_GRACE_S` later, the lifespan stops the engine
   thread, and the process exits with status 0.
A second signal skips the waiting. What this is not: the routes (`app`) or the engine thread (`bridge`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import uvicorn

from cairn.config import EngineConfig
from cairn.engine import Engine
from cairn.server.access_log import AccessLog
from cairn.server.app import create_app
from cairn.server.options import ServerOptions

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 2.0  # after the bridge's abort deadline, how long streams get to send their last event


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the engine at shutdown and exits 0 after a signal.

    (uvicorn itself re-raises the signal once it has shut down, ending the process with -SIGTERM.)
    """

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        log.info("signal %d: shutting down", sig)

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


def serve(engine_config: EngineConfig, options: ServerOptions) -> int:
    """Serve until SIGTERM / SIGINT; returns the process exit status."""
    engine = Engine(engine_config)
    app = create_app(engine, options)
    bridge = app.state.ctx.bridge
    config = uvicorn.Config(AccessLog(app) if options.access_log else app, host=options.host, port=options.port,
                            log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=options.shutdown_timeout_s + SHUTDOWN_GRACE_S)
    server = GracefulServer(config, lambda: bridge.drain(options.shutdown_timeout_s))
    log.info("serving %s (context %d tokens) on http://%s:%d", app.state.ctx.served_model, engine.max_model_len,
             options.host, options.port)
    server.run()
    return 0 if server.started else 1
