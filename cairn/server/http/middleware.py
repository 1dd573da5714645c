"""Pure ASGI middlewares: body limits (413, 408), the API key (401), X-Request-Id, the request counter, JSON
bodies only (415), the Host a loopback server answers (421), and the connection cap's answer (503).

`BodySizeLimit` refuses a body over `max_bytes` before the app sees it: from Content-Length when the
client sends one, else by counting while reading (chunked bodies); a body that takes longer than
`timeout_s` to arrive gets a 408. It buffers the accepted body and replays it to the app in the chunks
it arrived in (never joined: a copy of megabytes would hold the interpreter lock the engine thread
needs), then hands later `receive` calls (the disconnect) through untouched. Past its first
PACE_AFTER_BYTES, a body is read no faster than `max_bytes_per_s` (see `_pace`).

`APIKeyAuth` answers 401 to a request without a key, except on public paths. The key is read from
`Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's), on every path. With
`tenants` (--cache-isolation per-key) it notes in the request's scope state which key it was, as a keyed hash
(`key_tenant`), and `cache_salt` makes that the namespace of the request's prefix cache: a tenant never resumes
another's prefix, nor learns from cached_tokens or timing what another sent (the key itself is kept nowhere).

`RequestId` echoes a client's `X-Request-Id` header on the response and exposes it, while the request
is handled, through `current_request_id()` (a context variable), for ids and log lines.

`JSONBodiesOnly` answers 415 to a POST whose Content-Type is not `application/json` or `application/*+json`:
a browser sends a page's cross-origin POST of `text/plain` (or a form) without asking first (no CORS
preflight), so parsing such a body as JSON let any page the user visits drive the server.

`HostCheck` answers 421 to a request whose Host names no name of this server (the names are given: see
`ServerOptions.host_names`), so a page whose own name a DNS rebinding points at 127.0.0.1 cannot read the
answers. A request without Host (HTTP/1.0, not a browser's) passes.

`ConnectionCap` answers 503 to a request that arrived on a connection over --max-connections (the protocol
marks its scope: see `connections`), but on PROBE_PATHS: a busy server is alive (/health), and /ready
says it is not ready.

`RequestCounter` counts every HTTP response by route and status code into a prometheus Counter, when
it ends, 413s and 404s included; paths outside the known routes count as endpoint "other" so that the
label set stays bounded. A response the client dropped before its last byte counts as 499, a stream
included (its 200 was sent first): `ResponseEnd` decides, for the counter and the access log.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable, Collection

from prometheus_client import Counter

from cairn.server.errors import APIError

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("cairn_request_id", default=None)
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._:-]")
MAX_REQUEST_ID_CHARS = 64  # of a client's X-Request-Id, as used in ids and logs
PACE_AFTER_BYTES = 256 << 10  # a body's first bytes, read at full speed (every body up to this size)
CLIENT_CLOSED = 499  # the status of a response the client disconnected from before its end (nginx's)
OVER_CAP = "cairn.over_connection_cap"  # in the scope of a request on a connection over --max-connections
PROBE_PATHS = frozenset({"/health", "/ready"})  # answered on such a connection too (/ready: not ready)
JSON_MEDIA_TYPE = re.compile(r"application/(?:[\w.+-]+\+)?json")


def current_request_id() -> str | None:
    """The client's X-Request-Id for the request being handled (made safe for ids and logs), or None."""
    return _REQUEST_ID.get()


async def send_error(send: Send, error: APIError, scope: Scope) -> None:
    """The error as a whole response, in the shape of the API the request was for (errors.py)."""
    body = error.body_bytes(scope.get("path", ""))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"),
               *((k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {max_bytes} bytes.",
                    code="request_too_large")


def _too_slow(timeout_s: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {timeout_s:g}s.", code="request_timeout")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 0.0, max_bytes_per_s: float = 0.0):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s  # 0: no deadline
        self.max_bytes_per_s = max_bytes_per_s  # past PACE_AFTER_BYTES, the fastest a body is read; 0: no limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, _too_large(self.max_bytes), scope)
        try:
            async with asyncio.timeout(self.timeout_s or None):
                body = await self._read_body(receive)
        except TimeoutError:
            return await send_error(send, _too_slow(self.timeout_s), scope)
        if body is None:
            return await send_error(send, _too_large(self.max_bytes), scope)
        chunks = collections.deque(body or [b""])
        del body  # (the app gets the chunks, and frees each once it is done with it: see `workers`)

        async def replay() -> Message:
            if chunks:
                chunk = chunks.popleft()
                return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> list[bytes] | None:
        """The whole body as its chunks, or None as soon as it passes max_bytes."""
        chunks, size = [], 0
        start_s = asyncio.get_running_loop().time()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
            await self._pace(size, start_s)
        return chunks

    async def _pace(self, size: int, start_s: float) -> None:
        """Sleep while the body read so far is ahead of max_bytes_per_s (its first PACE_AFTER_BYTES free).

        Receiving a body costs the event loop CPU in pieces (a read, its hand-over to the app: with the
        copies of h11 below DIRECT_BODY_BYTES, without them above, see `connections`), holding the
        interpreter lock the engine thread takes back after every torch op. Over loopback or a fast link,
        megabytes arrive back to back: the loop then runs without a pause and the engine's steps around
        it take longer (1.3-1.4x while a 20 MiB body arrives unpaced past h11, 1.05-1.2x paced; quiet, the
        demo model; stall_bench.py). While the loop sleeps here, uvicorn stops reading the socket (its
        flow control pauses above 64 KiB not taken by the app), so the client waits on TCP and the cost
        is spread over time. At 128 MiB/s a 20 MiB body takes 160 ms more at
        most; a client sending slower than the limit (most networks) never waits.
        """
        if self.max_bytes_per_s <= 0 or size <= PACE_AFTER_BYTES:
            return
        ahead_s = (size - PACE_AFTER_BYTES) / self.max_bytes_per_s - (asyncio.get_running_loop().time() - start_s)
        if ahead_s > 0:
            await asyncio.sleep(ahead_s)


class ResponseEnd:
    """How one request's response ended, from the ASGI messages passed through `receive` and `send`:
    `on_end(status)` is called once, just before the last body is sent, or by `finish()` (call it when the
    app returns) if it never was. The status is the one the app sent, or CLIENT_CLOSED when the client
    disconnected before the last body: a stream it dropped (the app had sent 200 first), or a whole
    answer it did not wait for (the app sends its 499 itself). None: no response was started and the
    client did not leave."""

    def __init__(self, receive: Receive, send: Send, on_end: Callable[[int | None], None]):
        self._receive, self._send, self._on_end = receive, send, on_end
        self.sent_status: int | None = None  # the app's http.response.start status
        self.headers: list[tuple[bytes, bytes]] = []  # the app's response headers
        self.client_gone = False  # an http.disconnect was received
        self.ended = False

    @property
    def status(self) -> int | None:
        return CLIENT_CLOSED if self.client_gone else self.sent_status

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self.ended:
            self.client_gone = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.sent_status, self.headers = message["status"], message.get("headers", [])
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finish()
        await self._send(message)

    def finish(self) -> None:
        if not self.ended:
            self.ended = True
            self._on_end(self.status)


class RequestCounter:
    def __init__(self, app: ASGIApp, counter: Counter, endpoints: Collection[str]):
        self.app = app
        self.counter = counter
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"

        def count(status: int | None) -> None:
            if status is not None:
                self.counter.labels(endpoint, str(status)).inc()

        end = ResponseEnd(receive, send, count)
        try:
            await self.app(scope, end.receive, end.send)
        finally:
            end.finish()


TENANT = "cairn.cache_tenant"  # the scope state key APIKeyAuth notes a request's tenant under (per-key isolation)


def key_tenant(key: bytes) -> str:
    """The tenant of an API key: a keyed hash (fixed length), so that neither a cache key nor a log holds the key."""
    return hashlib.blake2b(key, key=b"cairn.cache-isolation", digest_size=16).hexdigest()


def cache_salt(scope: Scope, salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its own `cache_salt` field, inside its API key's tenant when the
    server isolates the cache per key (the tenant is fixed-length, so no salt of one tenant is another's)."""
    tenant = scope.get("state", {}).get(TENANT)
    if tenant is None:
        return salt
    return f"key:{tenant}" if salt is None else f"key:{tenant}:{salt}"


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_keys: Collection[str], public_paths: Collection[str], tenants: bool = False):
        self.app = app
        self.keys = [key.encode() for key in api_keys]
        self.public_paths = frozenset(public_paths)
        self.tenants = tenants  # note each request's key_tenant in its scope state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.public_paths:
            return await self.app(scope, receive, send)
        key = self._key_of(scope)
        if key is not None:
            if self.tenants:
                scope.setdefault("state", {})[TENANT] = key_tenant(key)
            return await self.app(scope, receive, send)
        await send_error(send, APIError(401, "A valid API key is required: send the header 'Authorization: "
                                             "Bearer <key>' or 'x-api-key: <key>'.", code="invalid_api_key",
                                        headers={"WWW-Authenticate": "Bearer"}), scope)

    def _key_of(self, scope: Scope) -> bytes | None:
        """The key either header holds, or None (each key compared in constant time, every one of them)."""
        headers = dict(scope.get("headers", []))
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        given = [bearer.strip()] if scheme.lower() == b"bearer" else []
        given.append(headers.get(b"x-api-key", b"").strip())
        found = None
        for key in self.keys:
            for value in given:
                if hmac.compare_digest(value, key):
                    found = key
        return found


class RequestId:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers", [])).get(b"x-request-id") if scope["type"] == "http" else None
        if not given:
            return await self.app(scope, receive, send)
        safe = _UNSAFE_ID_CHARS.sub("_", given.decode("latin-1"))[:MAX_REQUEST_ID_CHARS]

        async def echoing_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", given)]}
            await send(message)

        token = _REQUEST_ID.set(safe)
        try:
            await self.app(scope, receive, echoing_send)
        finally:
            _REQUEST_ID.reset(token)


class JSONBodiesOnly:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", [])).get(b"content-type", b"").decode("latin-1")
        if JSON_MEDIA_TYPE.fullmatch(given.partition(";")[0].strip().lower()):
            return await self.app(scope, receive, send)
        named = f"Content-Type {given[:80]!r}" if given else "no Content-Type"
        await send_error(send, APIError(415, f"The request body must be JSON, sent as Content-Type: application/json; "
                                             f"got {named}.", param="content-type", code="unsupported_media_type"),
                         scope)


def host_name(host: str) -> str:
    """The name in a Host header's value, without its port, lowercased: `[::1]:8000` -> `[::1]`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    name, _, port = host.rpartition(":")
    return (name if name and port.isdigit() else host).rstrip(".")


class HostCheck:
    def __init__(self, app: ASGIApp, names: Collection[str]):
        self.app = app
        self.names = frozenset(names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers", [])).get(b"host") if scope["type"] == "http" else None
        if given is None or host_name(given.decode("latin-1")) in self.names:
            return await self.app(scope, receive, send)
        await send_error(send, APIError(421, f"Host {given.decode('latin-1')[:80]!r} does not name this server, which "
                                             f"answers {', '.join(sorted(self.names))} (--allowed-hosts adds names).",
                                        param="host", code="invalid_host"), scope)


class ConnectionCap:
    def __init__(self, app: ASGIApp, max_connections: int):
        self.app = app
        self.max_connections = max_connections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not scope.get(OVER_CAP) or scope.get("path") in PROBE_PATHS:
            return await self.app(scope, receive, send)
        await send_error(send, too_many_connections(self.max_connections), scope)


def too_many_connections(max_connections: int) -> APIError:
    return APIError(503, f"The server has {max_connections} connections open, its limit; retry later.",
                    "server_error", code="too_many_connections", headers={"Retry-After": "1"})
