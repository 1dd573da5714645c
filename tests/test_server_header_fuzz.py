"""Hostile request heads against the app in-process: no header and no query string makes any route answer 5xx
or log a traceback (issue 43; the bodies: test_server_fuzz.py).

Each request is written as the bytes a client sends and read by h11 as `cairn serve` reads it (uvicorn's h11
protocol): the app gets the scope uvicorn builds from h11's event (header names lowercased, values the raw
latin-1 bytes, the query string as sent, the path percent-decoded) and the body as h11 frames it, by
Content-Length (cut short where it says less than was sent; where it says more, the rest never comes and the
body deadline answers) or chunked. Its answer goes back through h11 as uvicorn sends it, so a header h11 would
refuse to send (the traceback uvicorn logs then) fails the test too. A head h11 refuses (no Host or a second
one, two Content-Lengths that differ, one that is not digits, a Transfer-Encoding but chunked) is uvicorn's 400
and never reaches the app; h11 limits only a head still incomplete (16 KiB), so one that arrives whole, as
these do, reaches it at any size. Half the requests go to the app as `cairn serve` runs it on
loopback with an API key and CORS for one origin (behind the access log and the Host check, as `main.serve`
wraps it), half as on 0.0.0.0 (any Host) with CORS for any origin and no key; each has its own demo engine.

The property tests (hypothesis, derandomized: the same examples on every run) send a valid request to any
route (every GET, POST and DELETE one, a 404, a trailing-slash redirect; now and then as a CORS preflight, a
HEAD or HTTP/1.0). One test for each header name (and random names, hundreds of headers) adds, replaces or
repeats it with odd values (media types with parameters and charsets, Content-Lengths that disagree with the
body, Authorization forms, Hosts, Origins, latin-1 bytes, 8 KB values) and changes up to two more headers;
one test for each route sends it with a hostile query string (percent escapes of invalid UTF-8, repeated keys,
15 KB long), and a hostile id in the path of /v1/models/{name} and /v1/responses/{id}.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from dataclasses import dataclass
from urllib.parse import unquote

import h11
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.logs import TEXT_FORMAT, JsonFormatter
from cairn.server.app import create_app
from cairn.server.http.access_log import AccessLog
from cairn.server.http.middleware import HostCheck
from cairn.server.options import ServerOptions
from tests.test_server_fuzz import BODIES

KEY = "sk-fuzz"
ORIGIN = "http://app.example"
BODY_TIMEOUT_S = 0.25  # (a body whose Content-Length says more than was sent waits this long for its 408)
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
ROUTES = [("GET", p, None) for p in ("/health", "/ready", "/v1/models", "/v1/models/cairn-demo-random", "/metrics",
                                     "/v1/responses/resp_none", "/nope", "/health/")] + [
    ("DELETE", "/v1/responses/resp_none", None), ("POST", "/v1/chat/completions/", BODIES["/v1/chat/completions"][0]),
    *(("POST", path, body) for path, (body, _) in sorted(BODIES.items()))]
HEADER_EXAMPLES = 15  # for each header name (and random names, hundreds of headers): 480 in all
QUERY_EXAMPLES = 20  # for each route: 400 in all
ID_ROUTES = {"/v1/models/cairn-demo-random": "/v1/models/", "/v1/responses/resp_none": "/v1/responses/"}

TCHAR = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # (a header name's)
VCHAR = "".join(map(chr, [*range(0x21, 0x7F), *range(0x80, 0x100)]))  # (a header value's, with SP and HTAB)
NAMES = ["content-type", "content-length", "transfer-encoding", "authorization", "x-api-key", "accept",
         "accept-encoding", "accept-charset", "host", "origin", "x-request-id", "access-control-request-method",
         "access-control-request-headers", "connection", "upgrade", "expect", "cookie", "user-agent",
         "x-forwarded-for", "x-forwarded-host", "forwarded", "content-encoding", "te", "trailer", "range",
         "anthropic-version", "anthropic-beta", "openai-organization", "idempotency-key", "keep-alive"]
ODD = ["", "x", "\xff", "\x80\x81", "\xe9t\xe9", "a\tb", "a b c", "=", ",,,", ";", '"', "\\", "%00", "%ff",
       "x" * 8000, "\xff" * 4000, "0", "-1", "null", "{}", "\u00e9" * 3]
VALUES = {
    "content-type": ["application/json; charset=latin-1", 'application/json; charset="utf-8"',
                     "application/json;charset=utf-16", "application/json; boundary=x; charset=", "application/json ;",
                     "application/json;;", "APPLICATION/JSON; CHARSET=UTF-8", "application/json, text/plain",
                     "application/ld+json", "application/+json", "application/json\tx", "application/json\xff",
                     "application/json; charset=\xe9", "text/json", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=----x", "*/*", ";"],
    "authorization": ["Bearer", "Bearer ", f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}", f"Bearer {KEY} x",
                      "Basic c2stZnV6ejo=", f"Bearer {KEY[:-1]}", f"Bearer {KEY}z", "Bearer \xff\xfe", f"Token {KEY}",
                      KEY, f"Bearer\t{KEY}"],
    "x-api-key": [KEY, f"{KEY} ", KEY.upper(), "\xff", KEY * 1000],
    "content-length": ["0", "1", "2", "-1", "+1", "1e3", "0x10", "00000000000000000007", "9" * 30, "4294967296",
                       str(32 * (1 << 20) + 1), " 5"],
    "transfer-encoding": ["chunked", "Chunked", "gzip, chunked", "chunked, chunked", "identity", "gzip"],
    "host": ["127.0.0.1:8000", "localhost", "LOCALHOST.", "[::1]:8000", "[::1", "[", "]", "[x]", "[::1]:x", ":",
             ":8000", "localhost:", "127.0.0.1:99999999", "evil.example", "testserver", "a b", "\xff\xfe",
             "localhost:8000:9000", "x" * 300],
    "origin": [ORIGIN, "null", "http://evil.example", ORIGIN + "/", "*", "\xff", "http://[::1"],
    "accept": ["text/event-stream", "application/json;q=0.5, */*;q=0.1", "*/*", "text/html", "application/json; q=x"],
    "access-control-request-method": ["POST", "GET", "PUT", "post", "\xff"],
    "access-control-request-headers": ["content-type, authorization", "x-evil", "Content-Type,,", "\xff"],
    "connection": ["close", "upgrade", "keep-alive, upgrade", "\xff"],
    "upgrade": ["websocket", "h2c", "\xff"],
    "expect": ["100-continue", "200-ok"],
    "x-request-id": ["abc", "\xff\xfe", "a\tb", "x" * 5000, "../../etc", "%0d%0a"],
}


# ---- the wire: a request as bytes, read and answered by h11 as uvicorn does ----------------------------

@dataclass
class Parsed:
    request: h11.Request
    body: list[bytes]  # the body as h11 framed it
    complete: bool  # False: Content-Length says more than was sent (the rest never comes)
    conn: h11.Connection


def on_the_wire(method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                version: bytes = b"1.1") -> Parsed | str:
    """The request `cairn serve` reads from these bytes, or h11's reason to refuse it (uvicorn's 400)."""
    if any(name.lower() == b"transfer-encoding" for name, _ in headers):
        half = len(body) // 2
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:]) if p) + b"0\r\n\r\n"
    head = b"%s %s HTTP/%s\r\n" % (method.encode(), target, version)
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head + b"".join(b"%s: %s\r\n" % header for header in headers) + b"\r\n" + body)
    request, chunks = None, []
    while True:
        try:
            got = conn.next_event()
        except h11.RemoteProtocolError as e:
            return str(e)
        if isinstance(got, h11.Request):
            request = got
        elif isinstance(got, h11.Data):
            chunks.append(bytes(got.data))
        elif isinstance(got, h11.EndOfMessage) or got is h11.NEED_DATA:
            return Parsed(request, chunks, got is not h11.NEED_DATA, conn) if request else "an incomplete head"


@dataclass
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Wire:
    """Between the TestClient and the app: the next request's scope and body are `parsed`'s (as uvicorn's
    h11 protocol builds them), and its answer is sent through h11 (which refuses a header it cannot send)."""

    def __init__(self, app):
        self.app = app
        self.client: TestClient | None = None
        self.next: Parsed | None = None

    def send(self, parsed: Parsed) -> Answer:
        self.next = parsed
        r = self.client.request(parsed.request.method.decode(), "/")
        return Answer(r.status_code, self.raw_headers, self.raw_body)  # (as the app sent them: a HEAD's body too)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.next is None:
            return await self.app(scope, receive, send)
        parsed, self.next = self.next, None
        request, conn = parsed.request, parsed.conn
        raw_path, _, query = request.target.partition(b"?")
        headers = [(name.lower(), value) for name, value in request.headers]
        scope = {**scope, "method": request.method.decode("ascii"), "http_version": request.http_version.decode(),
                 "path": unquote(raw_path.decode("ascii")), "raw_path": raw_path, "query_string": query,
                 "headers": headers}
        chunks = collections.deque(parsed.body)
        body_sent = False

        async def wire_receive():
            nonlocal body_sent
            if not body_sent:
                if chunks or parsed.complete:
                    chunk = chunks.popleft() if chunks else b""
                    body_sent = parsed.complete and not chunks
                    return {"type": "http.request", "body": chunk, "more_body": not body_sent}
                await asyncio.Event().wait()  # the rest of the body never comes
            while (message := await receive())["type"] != "http.disconnect":
                pass  # (the TestClient's own empty body)
            return message

        async def wire_send(message) -> None:
            if message["type"] == "http.response.start":
                self.raw_headers, self.raw_body = [(b"server", b"uvicorn"), *message.get("headers", [])], b""
                conn.send(h11.Response(status_code=message["status"], headers=self.raw_headers))
                message = {**message, "headers": [(k, v.decode("latin-1").encode("ascii", "backslashreplace"))
                                                  for k, v in self.raw_headers]}  # (what the TestClient takes)
            elif message["type"] == "http.response.body":
                self.raw_body += message.get("body", b"")
                conn.send(h11.Data(data=b"" if request.method == b"HEAD" else message.get("body", b"")))
                if not message.get("more_body", False):
                    conn.send(h11.EndOfMessage())
                    if conn.our_state is h11.MUST_CLOSE:
                        conn.send(h11.ConnectionClosed())
            await send(message)

        await self.app(scope, wire_receive, wire_send)


@contextlib.contextmanager
def serving(loopback: bool):
    """The app as `cairn serve` runs it: on loopback with an API key, CORS for one origin and the Host check;
    or on every interface (any Host) with CORS for any origin and no key."""
    config = config_with_overrides(EngineConfig(), kv_cache_gib=0.01, state_cache_gib=0.01, max_model_len=64,
                                   max_num_seqs=4)
    options = ServerOptions(host="127.0.0.1" if loopback else "0.0.0.0", api_key=KEY if loopback else None,
                            allowed_origins=ORIGIN if loopback else "*", body_timeout_s=BODY_TIMEOUT_S)
    app = create_app(Engine(config), options)
    wire = Wire(AccessLog(app if options.host_names is None else HostCheck(app, options.host_names)))
    with TestClient(wire, follow_redirects=False) as client:  # (a handler's exception fails the test)
        wire.client = client
        yield wire


@pytest.fixture(scope="module")
def wires():
    """{loopback: its Wire}: both servings, each its own engine."""
    with serving(True) as loopback, serving(False) as any_host:
        yield {True: loopback, False: any_host}


def valid_request(method: str, path: str, body: dict | None, stream: bool) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body a client sends for this route (with the key, to the loopback Host)."""
    headers = [(b"host", b"127.0.0.1:8000"), (b"authorization", f"Bearer {KEY}".encode()), (b"user-agent", b"fuzz")]
    if body is None:
        return headers, b""
    content = json.dumps({**body, "stream": True} if stream and path in GENERATION else body).encode()
    return headers + [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())], content


def check_answer(wires: dict[bool, Wire], parsed: Parsed | str, loopback: bool, caplog) -> Answer | None:
    """Send the request; its answer is no 5xx and nothing logged an error, a traceback or failed to format."""
    if isinstance(parsed, str):
        event(f"refused by h11 (uvicorn's 400): {parsed}")
        return None
    before = len(caplog.records)
    answer = wires[loopback].send(parsed)
    event(f"answered {answer.status // 100}xx")
    assert answer.status < 500, (parsed.request, answer)
    for record in caplog.records[before:]:
        assert record.levelno < logging.ERROR and not record.exc_info, (parsed.request, record.getMessage())
        JsonFormatter().format(record)  # (a record the handler cannot format is a traceback on stderr)
        logging.Formatter(TEXT_FORMAT).format(record)
    if answer.status >= 400 and (b"content-type", b"application/json") in answer.headers:
        error = json.loads(answer.body)["error"]
        assert error["message"], answer
    return answer


# ---- headers ----------------------------------------------------------------------------------------

def latin1(text: str) -> bytes:
    return text.encode("latin-1")


random_names = st.text(TCHAR, min_size=1, max_size=12)
any_values = st.lists(st.text(VCHAR, min_size=1, max_size=12), max_size=4).flatmap(
    lambda words: st.sampled_from([" ", "\t", "  "]).map(lambda sep: sep.join(words)))


def values_of(name: bytes, content: bytes) -> st.SearchStrategy[bytes]:
    """Odd values for a header `name` (with a body `content`): its own, any header's, random ones."""
    own = VALUES.get(name.decode("latin-1").lower(), [])
    if name.lower() == b"content-length":  # (what disagrees with the body sent)
        own = own + [str(len(content) + d) for d in (-len(content), -1, 1, 100)]
    return st.one_of(st.sampled_from(own + ODD), any_values).map(latin1)


@st.composite
def hostile_heads(draw, fuzzed: str) -> tuple[Parsed | str, bool]:
    """A valid request to any route, its header `fuzzed` (or a random name, or hundreds of headers) added,
    replaced or repeated with odd values; then up to two more headers added, replaced, dropped."""
    method, path, body = draw(st.sampled_from(ROUTES))
    headers, content = valid_request(method, path, body, draw(st.booleans()))
    method = {0: "OPTIONS", 1: "HEAD"}.get(draw(st.integers(0, 7)), method)  # (OPTIONS: a CORS preflight)
    if fuzzed == "hundreds":
        headers += [(b"x-fuzz-%d" % i, b"v" * (i % 7)) for i in range(draw(st.sampled_from([100, 400])))]
    else:
        name = latin1(draw(random_names) if fuzzed == "random" else fuzzed)
        name = draw(st.sampled_from([name, name.upper(), name.title()]))
        at = next((i for i, (n, _) in enumerate(headers) if n == name.lower()), None)
        how = draw(st.sampled_from(["add", "repeat"] if at is None else ["replace", "replace", "add", "repeat"]))
        if how == "replace":
            headers[at] = (name, draw(values_of(name, content)))
        else:
            for _ in range(1 if how == "add" else draw(st.integers(2, 3))):
                headers.insert(draw(st.integers(0, len(headers))), (name, draw(values_of(name, content))))
    for _ in range(draw(st.integers(0, 2))):
        how, at = draw(st.sampled_from(["add", "replace", "drop"])), draw(st.integers(0, len(headers) - 1))
        name = draw(st.sampled_from(NAMES) | random_names).encode() if how == "add" else headers[at][0]
        if how == "drop":
            del headers[at]
        elif how == "replace":
            headers[at] = (name, draw(values_of(name, content)))
        else:
            headers.insert(at, (name, draw(values_of(name, content))))
    version = draw(st.sampled_from([b"1.1"] * 7 + [b"1.0"]))
    return on_the_wire(method, path.encode(), headers, content, version), draw(st.booleans())


FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("fuzzed", [*NAMES, "random", "hundreds"])
@settings(FUZZ, max_examples=HEADER_EXAMPLES)
@given(data=st.data())
def test_no_request_header_makes_any_route_answer_5xx_or_log_a_traceback(wires, fuzzed, data, caplog):
    caplog.set_level(logging.DEBUG, logger="cairn.access")
    check_answer(wires, *data.draw(hostile_heads(fuzzed)), caplog)


# ---- query strings ----------------------------------------------------------------------------------

QCHAR = "".join(map(chr, range(0x21, 0x7F)))  # (what h11 takes in a request target)
ESCAPES = ["%ff", "%ed%a0%80", "%c3%28", "%f0%9f%98%80", "%f4%90%80%80", "%00", "%0d%0a", "%", "%z", "%2", "%%", "%25",
           "%26", "%3D", "%3F", "%23", "+", "%2B", "%e2%80%ae", "%c0%af", "%fe%ff", "%C3%A9", "%5B%5D", "%7F"]
pieces = st.one_of(st.text(QCHAR, max_size=8), st.sampled_from(ESCAPES),
                   st.lists(st.sampled_from(ESCAPES), min_size=2, max_size=4).map("".join))
LONG = ["a=" + "x" * 15000, "k=" + "%ff" * 4000, "&".join(["a=1"] * 3000), "%ed%a0%80" * 1500, "x" * 17000]


@st.composite
def queries(draw) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(LONG))
    keys = draw(st.lists(pieces, min_size=1, max_size=3))
    pairs = [(draw(st.sampled_from(keys)), draw(st.one_of(st.none(), pieces))) for _ in range(draw(st.integers(1, 6)))]
    separator = draw(st.sampled_from(["&", "&", ";", "&&"]))
    return separator.join(key if value is None else f"{key}={value}" for key, value in pairs)


@st.composite
def hostile_targets(draw, route: tuple) -> tuple[Parsed | str, bool]:
    """A valid request to `route` with a hostile query string (and id in its path, where it has one)."""
    method, path, body = route
    headers, content = valid_request(method, path, body, draw(st.booleans()))
    if path in ID_ROUTES and draw(st.booleans()):
        path = ID_ROUTES[path] + draw(st.text(QCHAR.replace("?", "").replace("#", ""), max_size=8) | pieces)
    target = path + draw(st.sampled_from(["?", "??", "?#"])) + draw(queries())
    return on_the_wire(method, target.encode(), headers, content), draw(st.booleans())


@pytest.mark.parametrize("route", ROUTES, ids=[f"{method} {path}" for method, path, _ in ROUTES])
@settings(FUZZ, max_examples=QUERY_EXAMPLES)
@given(data=st.data())
def test_no_query_string_makes_any_route_answer_5xx_or_log_a_traceback(wires, route, data, caplog):
    caplog.set_level(logging.DEBUG, logger="cairn.access")
    check_answer(wires, *data.draw(hostile_targets(route)), caplog)
