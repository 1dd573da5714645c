"""uvicorn's HTTP/1.1 protocol (h11) with the two guards uvicorn lacks (a deadline for each request
head, and a cap on open connections), and a large body received past h11.

- head deadline: from the moment a connection opens (or its previous response ends), the client has
  `header_timeout_s` to send a complete request line and headers; otherwise it gets a 408 and the
  connection is closed. A client trickling its headers (slowloris) cannot hold a connection.
- connection cap: a connection opened while `max_connections` others are open gets a 503 and is closed.
  With `probes_over_cap` (cairn serve's, for its /health: a busy server is alive) its request is read
  first, if its head arrives within OVER_CAP_HEAD_TIMEOUT_S and fewer than CAP_HEADROOM others are over
  the cap: the request's scope is marked (`middleware.OVER_CAP`), the app answers /health and /ready and
  503 to the rest (`middleware.ConnectionCap`), and the connection closes after that answer. Otherwise
  the 503 is sent before anything is read.
- large body past h11: a request whose Content-Length is DIRECT_BODY_BYTES or more (and that is not
  chunked: Transfer-Encoding wins, and its framing is h11's) gets its body
  as the transport read it, each piece handed to the app as it is (`_take_body`), never given to
  h11. Through h11 and uvicorn every byte is copied four times (h11's buffer, the extracted event,
  uvicorn's body buffer, the message) while holding the interpreter lock: 14-34 ms of the event
  loop per 20 MiB, in pieces the engine thread waits behind between its torch ops. The transport's
  own read (a socket recv) copies with the lock released; it reads up to DIRECT_READ_BYTES at a
  time (asyncio's default is 256 KiB), so that the loop wakes a quarter as often per body. h11
  then never sees the end of that request, so the connection closes after its response
  (`connection: close`): huge bodies are rare, and a new connection costs nothing beside them.
  Bytes sent after that body (a pipelined request) are dropped.

The guards' answers are OpenAI-shaped JSON written straight to the socket (no request exists yet for the
app to answer), then the connection is closed in stages: its write side at once, the rest once the client
closes its own or after LINGER_S, what it sends meanwhile read and dropped. Closing a socket whose peer's
bytes are unread (or still coming: a client sends its request at once) answers them with a reset, and an
asyncio client (httpx.AsyncClient, AsyncOpenAI) whose send fails on it never reads the answer it had
received. The request body's deadline is the app's: see `middleware.BodySizeLimit`.
What this is not: routes or ASGI middlewares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import h11
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.h11_impl import H11Protocol

from cairn.server.errors import APIError
from cairn.server.http.middleware import OVER_CAP, too_many_connections

log = logging.getLogger(__name__)
REASONS = {408: b"Request Timeout", 503: b"Service Unavailable"}
DIRECT_BODY_BYTES = 1 << 20  # a Content-Length body from this size on is received past h11 (see the docstring)
DIRECT_READ_BYTES = 1 << 20  # the socket read size while a body is received past h11
CLOSE_HEADER = (b"connection", b"close")
CAP_HEADROOM = 16  # connections over max_connections whose request is read (to answer /health), at most
OVER_CAP_HEAD_TIMEOUT_S = 0.25  # how long such a connection's request head may take (a probe sends it at once)
LINGER_S = 2.0  # after a guard's answer, how long a client that keeps its end open is read (and ignored)


def guarded_protocol(header_timeout_s: float, max_connections: int,
                     probes_over_cap: bool = False) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...); 0 turns either guard off."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "max_connections": max_connections, "probes_over_cap": probes_over_cap})


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = 0.0  # seconds a request head may take to arrive; 0: no deadline
    max_connections: int = 0  # open connections allowed at once; 0: no cap
    probes_over_cap: bool = False  # read the request of a connection over the cap (the app answers its probes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._direct_body_bytes: int | None = None  # while a body is received past h11: the bytes still due
        self._linger_timer: asyncio.TimerHandle | None = None  # once a guard answered: closes the connection
        num_over = len(self.connections) - self.max_connections if self.max_connections else 0
        self._over_cap = num_over > 0  # its one request is answered 503, but the app's probes
        if self._over_cap:
            log.warning("connection from %s over the cap: %d connections are open (--max-connections)",
                        _peer(self.client), self.max_connections)
        if self._over_cap and (not self.probes_over_cap or num_over > CAP_HEADROOM):
            self._answer_and_close(too_many_connections(self.max_connections))
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return  # a guard answered: what the client still sends is read only so that closing sends no reset
        if self._direct_body_bytes is None:
            return super().data_received(data)
        self._take_body(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: the app takes it from here (its task has not run yet)
            self._disarm_head_timer()
            self._direct_body_bytes = self._body_bytes_past_h11()
            if self._over_cap:
                self.cycle.scope[OVER_CAP] = True
                self.cycle.keep_alive = False

    def _body_bytes_past_h11(self) -> int | None:
        """How much of the new request's body to receive past h11 (None: all of it goes through h11).
        Called right after h11 produced the request head (and any body bytes that came with it, now in
        the cycle's body: its app has not run yet); from here h11 is never fed again on this connection."""
        if self.conn.their_state is not h11.SEND_BODY:
            return None
        headers = dict(self.headers)  # (as h11 validated them: one content-length, digits alone)
        declared = headers.get(b"content-length", b"")
        if b"transfer-encoding" in headers or not declared.isdigit() or int(declared) < DIRECT_BODY_BYTES:
            return None  # (a chunked body, whatever its Content-Length says, needs h11's framing)
        self.cycle.keep_alive = False  # h11 never sees this request end: close the connection after the answer
        with contextlib.suppress(AttributeError):  # asyncio's socket transport reads max_size per recv (uvloop: fixed)
            self.transport.max_size = DIRECT_READ_BYTES
        if CLOSE_HEADER not in self.headers:
            self.headers.append(CLOSE_HEADER)  # (the scope's list: uvicorn then sends connection: close)
        return int(declared) - len(self.cycle.body)

    def _take_body(self, data: bytes) -> None:
        """Hand a piece of a body received past h11 to the app as it is (uvicorn's receive() makes no
        copy of a bytes body); bytes after the body's end (a pipelined request) are dropped: the
        connection closes after this response."""
        cycle, due = self.cycle, self._direct_body_bytes
        if due == 0:  # (the request's cycle is there until the connection closes, which stops the reads)
            return
        piece = data if len(data) <= due else data[:due]
        self._direct_body_bytes = due - len(piece)
        cycle.body = piece if not cycle.body else bytes(cycle.body) + piece
        if self._direct_body_bytes == 0:
            cycle.more_body = False
        elif len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()  # until the app's receive() takes it (uvicorn's own flow control)
        cycle.message_event.set()

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # before super(), which may start a pipelined request (and disarm it)
        super().on_response_complete()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        if self._over_cap:
            self._head_timer = self.loop.call_later(min(self.header_timeout_s or math.inf, OVER_CAP_HEAD_TIMEOUT_S),
                                                    self._head_timed_out)
        elif self.header_timeout_s > 0:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        assert self.cycle is None or self.cycle.response_complete, "a request head disarms the timer"
        if self.transport.is_closing():  # an answer the client has not read yet, on a connection that then closes
            return
        if self._over_cap:
            return self._answer_and_close(too_many_connections(self.max_connections))
        log.info("closed a connection from %s: no complete request head within %gs (--header-timeout-s)",
                 _peer(self.client), self.header_timeout_s)
        self._answer_and_close(APIError(408, f"The request head did not arrive within {self.header_timeout_s:g}s.",
                                        code="request_timeout"))

    def _answer_and_close(self, error: APIError) -> None:
        body = error.body_bytes()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (error.status, REASONS[error.status], len(body)))
        self.transport.write(head + body)
        if not self.transport.can_write_eof():  # (TLS: no half-close)
            self.transport.close()
            return
        self.transport.write_eof()  # the client reads the answer, then its end of the stream
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)  # (its EOF closes it sooner)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
