"""AccessLog: a pure ASGI middleware writing one concise line per HTTP request, when its response ends.

    access: 127.0.0.1 POST /v1/chat/completions 200 0.412 s

The time runs from the request's arrival to the response's last byte (a stream's `[DONE]`), so a
streamed completion shows its whole duration. A response the client disconnected from before its last
byte is logged as 499, a stream included (see middleware.ResponseEnd). Probes (`GET /health`,
`GET /metrics`) are logged at DEBUG so that a load balancer's polling does not drown the log. With
`--log-format json` the same facts are fields (method, path, status, duration_s, client, request_id
when the response carries an `x-request-id` header). It replaces uvicorn's own access log
(`--[no-]access-log` switches it).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable

from cairn.server.http.middleware import ResponseEnd

log = logging.getLogger("cairn.access")
QUIET_PATHS = frozenset({"/health", "/metrics"})
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")

Scope = dict
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


class AccessLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start_s = time.perf_counter()
        end = ResponseEnd(receive, send, lambda status: self._log(scope, status, end.headers, start_s))
        try:
            await self.app(scope, end.receive, end.send)
        finally:
            end.finish()  # the app ended without a last body (an error, a cancelled or dropped stream)

    @staticmethod
    def _log(scope: Scope, status: int | None, headers: list[tuple[bytes, bytes]], start_s: float) -> None:
        path = _escaped(scope.get("path", ""))
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        if not log.isEnabledFor(level):
            return
        status = 500 if status is None else status  # the app raised before answering
        request_id = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"), None)
        client = (scope.get("client") or ("-",))[0]
        duration_s = time.perf_counter() - start_s
        fields = {"event": "access", "client": client, "method": scope.get("method"), "path": path,
                  "status": status, "duration_s": round(duration_s, 4), "request_id": request_id}
        log.log(level, "%s %s %s %d %.3f s", client, fields["method"], path, status, duration_s,
                extra={"fields": fields})


def _escaped(path: str) -> str:
    """The path with its control characters escaped: it arrives percent-decoded, and `GET /%0a...` would
    otherwise write a forged line into a text log."""
    return CONTROL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", path)
