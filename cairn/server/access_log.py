"""AccessLog: a pure ASGI middleware writing one concise line per HTTP request, when its response ends.

    access: 127.0.0.1 POST /v1/chat/completions 200 0.412 s

The time runs from the request's arrival to the response's last byte (a stream's `[DONE]`), so a
streamed completion shows its whole duration. Probes (`GET /health`, `GET /metrics`) are logged at
DEBUG so that a load balancer's polling does not drown the log. With `--log-format json` the same
facts are fields (method, path, status, duration_s, client, request_id when the response carries an
`x-request-id` header). It replaces uvicorn's own access log (`--[no-]access-log` switches it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("cairn.access")
QUIET_PATHS = frozenset({"/health", "/metrics"})

Scope = dict
Message = dict
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


class AccessLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start_s = time.perf_counter()
        seen = {"status": 500, "request_id": None, "logged": False}

        async def logging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                seen["request_id"] = next((v.decode("latin-1") for k, v in message.get("headers", [])
                                           if k.lower() == b"x-request-id"), None)
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._log(scope, seen, start_s)

        try:
            await self.app(scope, receive, logging_send)
        finally:
            self._log(scope, seen, start_s)  # the app ended without a last body (an error, a cancelled stream)

    @staticmethod
    def _log(scope: Scope, seen: dict, start_s: float) -> None:
        if seen["logged"]:
            return
        seen["logged"] = True
        path = scope.get("path", "")
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        if not log.isEnabledFor(level):
            return
        client = (scope.get("client") or ("-",))[0]
        duration_s = time.perf_counter() - start_s
        fields = {"event": "access", "client": client, "method": scope.get("method"), "path": path,
                  "status": seen["status"], "duration_s": round(duration_s, 4), "request_id": seen["request_id"]}
        log.log(level, "%s %s %s %d %.3f s", client, fields["method"], path, seen["status"], duration_s,
                extra={"fields": fields})
