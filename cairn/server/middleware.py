"""Two pure ASGI middlewares: the request-body size limit (413) and the per-route request counter.

`BodySizeLimit` refuses a body over `max_bytes` before the app sees it: from Content-Length when the
client sends one, else by counting while reading (chunked bodies). It buffers the accepted body and
replays it to the app, then hands later `receive` calls (the disconnect) through untouched.

`RequestCounter` counts every HTTP response by route and status code into a prometheus Counter,
413s and 404s included; paths outside the known routes count as endpoint "other" so that the label
set stays bounded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

from prometheus_client import Counter

from cairn.server.errors import APIError

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, error: APIError) -> None:
    body = error.body_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {max_bytes} bytes.",
                    code="request_too_large")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, _too_large(self.max_bytes))
        body = await self._read_body(receive)
        if body is None:
            return await send_error(send, _too_large(self.max_bytes))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes max_bytes."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


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

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
