"""The router's ASGI app: the API routes of a cairn replica, each request passed to the best replica.

    POST /v1/chat/completions, /v1/completions, /v1/messages (Anthropic's), /v1/responses (OpenAI's Responses)
                                 send the request to the replica that resumes it fastest:
                                 a chat whose deepest known message prefix this router sent to replica R
                                 goes to R without a probe while R has at most PLACEMENT_SLACK more
                                 requests in flight than the least busy replica (affinity.py); any other
                                 request probes every available replica (POST /v1/cache/probe with the
                                 same body, /v1/cache/probe/messages for a Messages body,
                                 /v1/cache/probe/responses for a Responses body, concurrently,
                                 probe_timeout_s) and goes to the best ranked
                                 (replicas.py). Whole answers and SSE streams pass through byte for byte,
                                 with an `x-cairn-replica` header naming the replica. A Responses request
                                 whose previous_response_id this router saw answered (the replica's
                                 `x-cairn-response-id` header; REMEMBERED_RESPONSES of them, the oldest
                                 forgotten first) goes to the replica that stores it, unprobed; one it did
                                 not see is probed (only the replica storing it answers that probe)
    GET, DELETE /v1/responses/ID a stored response: to the replica that answered it, when this router saw
                                 it, else to the least busy available replica
    POST /v1/messages/count_tokens, /tokenize, /detokenize   to the least busy available replica (no probe:
                                 every replica of one model answers them alike)
    GET  /v1/models              every model the available replicas serve, each listed once (replicas of
                                 different models behind one router); when none lists any, the first
                                 replica's answer (a 401, ...) or a 503; /v1/models/NAME: the card of a
                                 replica serving NAME, else the first replica's 404
    GET  /health                 200 with every replica's state while one is available, else 503; how
                                 requests were routed (by placement, by probe, with none available)

A request body over max_request_bytes is answered 413, one slower than body_timeout_s 408, before any
replica is asked (the server's BodySizeLimit): the router holds each body whole, to probe and retry with.

A replica that fails before anything was sent to the client (connection refused or reset, a timeout,
a 502/503/504, or an error before the first body byte) is taken out for cooldown_s and the request is
tried on the next one (the failed answer is kept, to pass on when no replica does better, only when at
most MAX_HELD_ANSWER_BYTES long); once bytes have gone to the client the stream cannot move, and an error there
ends an SSE stream with a last error event (in the shape of the request's API, as are the router's own
errors). A background task polls each replica's
/health every health_interval_s and brings taken-out replicas back once they answer.

Memory: what passes on to the client is relayed chunk by chunk, never held. What the router reads whole (a
probe's answer, a model list, a failed answer it may pass on) it reads up to MAX_HELD_ANSWER_BYTES and no
further, probes, /health and model lists within probe_timeout_s in all: a replica answering with a huge or
never-ending body costs the router neither memory nor a stuck task.

What this is not: a replica (no engine, no tokenizer: the replicas tokenize their own probes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cairn.router.affinity import Placements, routing_keys
from cairn.router.options import RouterOptions
from cairn.router.replicas import Probe, Ranker, Replica
from cairn.server.http.middleware import BodySizeLimit
from cairn.server.openai.response_bodies import model_list

log = logging.getLogger(__name__)
T = TypeVar("T")
PROBE_PATHS = {"/v1/chat/completions": "/v1/cache/probe", "/v1/completions": "/v1/cache/probe",
               "/v1/messages": "/v1/cache/probe/messages",
               "/v1/responses": "/v1/cache/probe/responses"}  # a generation path -> the probe of its body
PASSED_THROUGH = ("/v1/messages/count_tokens", "/tokenize", "/detokenize")  # to any replica: no probe
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # their errors are in Anthropic's shape
FORWARDED_HEADERS = ("authorization", "x-api-key", "content-type", "accept", "x-request-id", "anthropic-version",
                     "anthropic-beta")  # the key: either
DROPPED_RESPONSE_HEADERS = ("content-length", "transfer-encoding", "connection", "content-encoding")
RETRY_STATUSES = (502, 503, 504)
PLACEMENT_SLACK = 1  # requests in flight a placed replica may have beyond the least busy one and still be used unprobed
INLINE_PARSE_BYTES = 256 * 1024  # a larger body is parsed for its prefix keys off the event loop
MAX_HELD_ANSWER_BYTES = 1 << 20  # the most of a replica's answer the router holds in memory (not relayed ones)
RESPONSE_ID_HEADER = "x-cairn-response-id"  # a replica's answer to POST /v1/responses names the response
REMEMBERED_RESPONSES = 1 << 16  # response ids whose replica the router remembers (the oldest forgotten first)


class TooLong(Exception):
    """A replica's answer that the router would hold is longer than MAX_HELD_ANSWER_BYTES."""


class ReplicaFailed(Exception):
    """The replica failed before anything reached the client: try another. `answer`: what it said, if
    anything (passed on when no replica does better)."""

    def __init__(self, why: str, answer: Response | None = None):
        super().__init__(why)
        self.answer = answer


class Router:
    def __init__(self, urls: list[str], options: RouterOptions):
        self.options = options
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.ranker = Ranker(options.queue_cost_s)
        timeout = httpx.Timeout(options.request_timeout_s, connect=options.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024))
        self.placements = Placements(options.remembered_prefixes)
        self.routed_by: Counter[str] = Counter()  # "placement", "probe", "none_available" -> requests
        self.response_holders = Placements(REMEMBERED_RESPONSES)  # a Responses id -> the replica storing it
        #   (kept when the replica is taken out: a replica back from a failure still stores what it stored)

    def available(self) -> list[Replica]:
        return [r for r in self.replicas if r.available()]

    # ---- health -----------------------------------------------------------------------------------

    async def poll_health(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            await asyncio.sleep(self.options.health_interval_s)

    async def _check(self, replica: Replica) -> None:
        try:
            async with asyncio.timeout(self.options.probe_timeout_s):  # the status alone: the body is never read
                async with self.client.stream("GET", replica.url + "/health",
                                              timeout=self.options.probe_timeout_s) as resp:
                    ok = resp.is_success
        except (httpx.HTTPError, TimeoutError) as e:
            ok, replica.last_error = False, f"health: {type(e).__name__}"
        if ok and not replica.healthy:
            log.info("replica %s answers /health again", replica.url)
        replica.healthy = ok  # (one taken out stays out until its cooldown ends, whatever /health says)

    # ---- probing ----------------------------------------------------------------------------------

    async def ranked(self, path: str, body: bytes, headers: dict, keys: list[bytes]) -> list[Replica]:
        """Replicas to try for this request, best first: the one its deepest known prefix (`keys`, affinity.py)
        was sent to, unprobed, when that one is available and not busier than PLACEMENT_SLACK allows; else
        every available replica probed and ranked; else (none available) every replica, soonest back first:
        a last resort rather than a refusal."""
        candidates = self.available()
        if not candidates:
            self.routed_by["none_available"] += 1
            return sorted(self.replicas, key=lambda r: r.down_until)
        placed = self._placed(keys, candidates)
        if placed is not None:
            self.routed_by["placement"] += 1
            return [placed, *(r for r in self.ranker.by_load(candidates) if r is not placed)]
        self.routed_by["probe"] += 1
        probes = await asyncio.gather(*(self._probe(r, PROBE_PATHS[path], body, headers) for r in candidates))
        return self.ranker.rank(candidates, dict(zip((r.url for r in candidates), probes, strict=True)))

    def _placed(self, keys: list[bytes], candidates: list[Replica]) -> Replica | None:
        found = self.placements.deepest(keys)
        replica = next((r for r in candidates if found is not None and r.url == found[1]), None)
        if replica is None or replica.num_in_flight > min(r.num_in_flight for r in candidates) + PLACEMENT_SLACK:
            return None
        return replica

    async def _probe(self, replica: Replica, probe_path: str, body: bytes, headers: dict) -> Probe | None:
        try:
            status, answer = await self._small_answer("POST", replica.url + probe_path, content=body, headers=headers)
        except (httpx.TimeoutException, TimeoutError, TooLong):
            return None  # slow now (or rambling): route to it by order alone
        except httpx.HTTPError as e:
            self._take_out(replica, f"probe: {type(e).__name__}: {e}")
            return None
        if status != 200:
            return None  # e.g. a replica without the probe endpoint, or a body it refuses (the request will say)
        try:
            data = json.loads(answer)
            est = data.get("est_ttft_s")
            return Probe(int(data.get("position", 0)), None if est is None else float(est), int(data.get("waiting", 0)),
                         int(data.get("running", 0)), int(data.get("tokens", 0)))
        except (ValueError, TypeError, AttributeError):
            return None

    async def _small_answer(self, method: str, url: str, **kwargs) -> tuple[int, bytes]:
        """(status, body) of a request whose answer the router reads whole (a probe, a model list), all of it
        within probe_timeout_s (TimeoutError, or httpx's, beyond) and at most MAX_HELD_ANSWER_BYTES of body
        (TooLong beyond: read no further)."""
        timeout_s = self.options.probe_timeout_s
        async with asyncio.timeout(timeout_s), self.client.stream(method, url, timeout=timeout_s, **kwargs) as resp:
            return resp.status_code, await _read_held(resp.aiter_bytes())

    def _take_out(self, replica: Replica, why: str) -> None:
        if replica.available():
            log.warning("replica %s taken out for %gs: %s", replica.url, self.options.cooldown_s, why)
        replica.take_out(why, self.options.cooldown_s)
        self.placements.forget(replica.url)

    # ---- forwarding -------------------------------------------------------------------------------

    async def forward(self, method: str, path: str, body: bytes, headers: dict, order: list[Replica],
                      keys: list[bytes] = ()) -> Response:
        """The first answer of the replicas in `order` that does not fail; a 200 records `keys` as placed on
        that replica. Each replica's count of requests in flight covers the request until its answer ends."""
        last: Response | None = None
        for replica in order:
            replica.num_in_flight += 1
            response = None
            try:
                response = await self._send(replica, method, path, body, headers)
            except ReplicaFailed as e:
                self._take_out(replica, str(e))
                last = e.answer or last
                continue
            finally:
                if response is None:  # no answer to hand the count to (failed, or cancelled at exit)
                    replica.num_in_flight -= 1
            if response.status_code == 200:
                self.placements.record(list(keys), replica.url)
            return response
        return last or _error(path, 503, "no replica could take the request", "no_replica")

    async def _send(self, replica: Replica, method: str, path: str, body: bytes, headers: dict) -> Response:
        request = self.client.build_request(method, replica.url + path, content=body, headers=headers)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise ReplicaFailed(f"{type(e).__name__}: {e}") from None
        chunks = resp.aiter_raw()
        try:
            first = await anext(chunks, b"")
        except httpx.HTTPError as e:
            await resp.aclose()
            raise ReplicaFailed(f"{type(e).__name__} before the first byte: {e}") from None
        if resp.status_code in RETRY_STATUSES:  # kept to pass on when no replica does better, unless too long
            try:
                held = await _read_held(_safe(chunks), first)
            except TooLong:
                held = None
            finally:
                await resp.aclose()
            answer = None if held is None else Response(held, resp.status_code, _response_headers(resp, replica))
            raise ReplicaFailed(f"answered {resp.status_code}", answer)
        replica.num_routed += 1
        streaming = resp.headers.get("content-type", "").startswith("text/event-stream")
        return _Relayed(replica, _relay(first, chunks, streaming, replica, resp, path), resp.status_code,
                        _response_headers(resp, replica), background=BackgroundTask(resp.aclose))

    # ---- stored responses (the Responses API) -----------------------------------------------------

    def holder_first(self, response_id: str | None) -> list[Replica] | None:
        """The available replica storing `response_id` (as far as this router saw), then the others by load;
        None when it is not known or not available."""
        found = self.response_holders.deepest([response_id.encode()]) if response_id else None
        holder = next((r for r in self.available() if found is not None and r.url == found[1]), None)
        if holder is None:
            return None
        return [holder, *(r for r in self.ranker.by_load(self.available()) if r is not holder)]

    def remember_response(self, response: Response) -> None:
        """The id of a Responses answer and the replica that stores it (`_Relayed`)."""
        response_id = response.headers.get(RESPONSE_ID_HEADER)
        if response.status_code != 200 or not response_id or not isinstance(response, _Relayed):
            return
        self.response_holders.record([response_id.encode()], response.replica.url)

    async def models_of(self, path: str, headers: dict) -> list[tuple[int, dict]]:
        """(status, body) of GET `path` (/v1/models or one model's) on each available replica (every replica
        when none is), concurrently; a replica that did not answer in probe_timeout_s with a JSON object is
        left out (its /health poll takes it out if it is down)."""
        async def ask(replica: Replica) -> tuple[int, dict] | None:
            try:
                status, answer = await self._small_answer("GET", replica.url + path, headers=headers)
                body = json.loads(answer)
            except (httpx.HTTPError, TimeoutError, TooLong, ValueError):
                return None
            return (status, body) if isinstance(body, dict) else None

        answers = await asyncio.gather(*(ask(r) for r in self.available() or self.replicas))
        return [answer for answer in answers if answer is not None]

    async def close(self) -> None:
        await self.client.aclose()


class _Relayed(StreamingResponse):
    """A replica's answer on its way to the client: however it ends (finished, failed, client gone, even
    before the first byte), the replica's count of requests in flight drops by one."""

    def __init__(self, replica: Replica, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replica = replica

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.replica.num_in_flight -= 1


def _first_answer(answers: list[tuple[int, dict]]) -> Response:
    """The first replica's answer (a 404 naming the model, a 401), or a 503 when none answered."""
    if not answers:
        return _error("/v1/models", 503, "no replica answered", "no_replica")
    status, body = answers[0]
    return JSONResponse(body, status)


def _union_by_id(lists: list[list]) -> list:
    """The models of every list, each id once (as the first list naming it gives it), in order."""
    seen: dict[object, object] = {}
    for models in lists:
        for model in models:
            key = model.get("id") if isinstance(model, dict) else None
            if key is not None and key not in seen:
                seen[key] = model
    return list(seen.values())


async def _read_body(body: bytes, read: Callable[[dict], T], default: T) -> T:
    """`read` of a body that is a JSON object, else `default`: a chat body's prefix keys (affinity.py), a Responses
    body's previous_response_id. A large body is parsed off the event loop."""
    def parse() -> T:
        try:
            data = json.loads(body)
        except ValueError:
            return default
        return read(data) if isinstance(data, dict) else default

    return await asyncio.to_thread(parse) if len(body) > INLINE_PARSE_BYTES else parse()


def _previous_response_id(data: dict) -> str | None:
    found = data.get("previous_response_id")
    return found if isinstance(found, str) else None


async def _read_held(chunks: AsyncIterator[bytes], first: bytes = b"") -> bytes:
    """`first` and the rest of an answer's chunks, joined; TooLong, reading no further, past MAX_HELD_ANSWER_BYTES."""
    parts, size = [first], len(first)
    async for chunk in chunks:
        size += len(chunk)
        if size > MAX_HELD_ANSWER_BYTES:
            raise TooLong(f"an answer of more than {MAX_HELD_ANSWER_BYTES} bytes")
        parts.append(chunk)
    if size > MAX_HELD_ANSWER_BYTES:
        raise TooLong(f"an answer of more than {MAX_HELD_ANSWER_BYTES} bytes")
    return b"".join(parts)


async def _safe(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    with contextlib.suppress(httpx.HTTPError):
        async for c in chunks:
            yield c


async def _relay(first: bytes, chunks: AsyncIterator[bytes], streaming: bool, replica: Replica,
                 resp: httpx.Response, path: str) -> AsyncIterator[bytes]:
    """The replica's body; however it ends (client gone included) the replica's response is closed, so a
    replica streaming to a client that left sees the disconnect and aborts the request."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as e:  # bytes already went to the client: the request cannot move
        log.warning("replica %s failed mid-response: %s", replica.url, e)
        if streaming:
            error = _error_body(path, f"the replica failed mid-stream: {e}", "replica_failed")
            event = "event: error\n" if path in ANTHROPIC_PATHS else ""
            yield f"{event}data: {json.dumps(error)}\n\n".encode()
    finally:
        await resp.aclose()


def _response_headers(resp: httpx.Response, replica: Replica) -> dict:
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS}
    headers["x-cairn-replica"] = replica.url
    return headers


def _request_headers(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def _error(path: str, status: int, message: str, code: str) -> JSONResponse:
    """The router's own error, in the shape of the API `path` belongs to."""
    return JSONResponse(_error_body(path, message, code), status)


def _error_body(path: str, message: str, code: str) -> dict:
    if path in ANTHROPIC_PATHS:
        return {"type": "error", "error": {"type": "api_error", "message": message}}
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def create_app(urls: list[str], options: RouterOptions) -> Starlette:
    router = Router(urls, options)

    async def generation(request: Request) -> Response:
        path, body, headers = request.url.path, await request.body(), _request_headers(request)
        keys = await _read_body(body, lambda data: routing_keys(path, data), [])
        order = None
        if path == "/v1/responses":
            order = router.holder_first(await _read_body(body, _previous_response_id, None))
        if order is not None:
            router.routed_by["response_holder"] += 1
        else:
            order = await router.ranked(path, body, headers, keys)
        response = await router.forward("POST", path, body, headers, order, keys)
        router.remember_response(response)
        return response

    async def stored_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        order = router.holder_first(response_id) or router.ranker.by_load(router.available()) or \
            sorted(router.replicas, key=lambda r: r.down_until)
        response = await router.forward(request.method, request.url.path, b"", _request_headers(request), order)
        if request.method == "DELETE" and response.status_code == 200:
            router.response_holders.drop(response_id.encode())
        return response

    async def passthrough(request: Request) -> Response:
        order = router.ranker.by_load(router.available()) or sorted(router.replicas, key=lambda r: r.down_until)
        return await router.forward("POST", request.url.path, await request.body(), _request_headers(request), order)

    async def models(request: Request) -> Response:
        answers = await router.models_of(request.url.path, _request_headers(request))
        lists = [body["data"] for status, body in answers if status == 200 and isinstance(body.get("data"), list)]
        if lists:
            return JSONResponse(model_list(_union_by_id(lists)))
        return _first_answer(answers)

    async def model(request: Request) -> Response:
        answers = await router.models_of(request.url.path, _request_headers(request))
        return _first_answer([answer for answer in answers if answer[0] == 200] or answers)

    async def health(_: Request) -> Response:
        ok = bool(router.available())
        return JSONResponse({"status": "ok" if ok else "no_replica", "replicas": [r.report() for r in router.replicas],
                             "routed_by": dict(router.routed_by), "remembered_prefixes": len(router.placements),
                             "remembered_responses": len(router.response_holders)},
                            200 if ok else 503)

    @asynccontextmanager
    async def lifespan(_: Starlette):
        poller = asyncio.create_task(router.poll_health())
        yield
        poller.cancel()
        await router.close()

    routes = [*(Route(path, generation, methods=["POST"]) for path in PROBE_PATHS),
              *(Route(path, passthrough, methods=["POST"]) for path in PASSED_THROUGH),
              Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=options.max_request_bytes, timeout_s=options.body_timeout_s)
    app.state.router = router
    return app
