"""uvicorn's HTTP/1.1 protocol (h11) with the two guards uvicorn lacks: a deadline for each request
head, and a cap on open connections.

- head deadline: from the moment a connection opens (or its previous response ends), the client has
  `header_timeout_s` to send a complete request line and headers; otherwise it gets a 408 and the
  connection is closed. A client trickling its headers (slowloris) cannot hold a connection.
- connection cap: a connection opened while `max_connections` others are open gets a 503 at once
  and is closed, before anything is read from it.

Both answers are OpenAI-shaped JSON written straight to the socket (no request exists yet for the
app to answer). The request body's deadline is the app's: see `middleware.BodySizeLimit`.
What this is not: routes or ASGI middlewares.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from cairn.server.errors import APIError

log = logging.getLogger(__name__)
REASONS = {408: b"Request Timeout", 503: b"Service Unavailable"}


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...); 0 turns either guard off."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = 0.0  # seconds a request head may take to arrive; 0: no deadline
    max_connections: int = 0  # open connections allowed at once; 0: no cap

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        if self.max_connections and len(self.connections) > self.max_connections:
            log.warning("refused a connection from %s: %d connections are open (--max-connections)",
                        _peer(self.client), self.max_connections)
            self._answer_and_close(APIError(503, f"The server has {self.max_connections} connections open, its "
                                                 "limit; retry later.", "server_error", code="too_many_connections"))
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: the app takes it from here
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # before super(), which may start a pipelined request (and disarm it)
        super().on_response_complete()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        if self.header_timeout_s > 0:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        log.info("closed a connection from %s: no complete request head within %gs (--header-timeout-s)",
                 _peer(self.client), self.header_timeout_s)
        self._answer_and_close(APIError(408, f"The request head did not arrive within {self.header_timeout_s:g}s.",
                                        code="request_timeout"))

    def _answer_and_close(self, error: APIError) -> None:
        body = error.body_bytes()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (error.status, REASONS[error.status], len(body)))
        self.transport.write(head + body)
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
