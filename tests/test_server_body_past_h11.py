"""Request bodies of DIRECT_BODY_BYTES or more, received past h11 (`connections.GuardedH11Protocol`),
on a real `cairn serve`: the same answer as a small body, the connection closed after the answer
(h11 never saw the request end), and a body that stops short, is cut off or is followed by a
pipelined request is answered or dropped while the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx

from cairn.server.http.connections import DIRECT_BODY_BYTES
from tests.server_process import served_fixture

BODY_TIMEOUT_S = 1.5
CHAT = {"model": "cairn-demo-random", "max_tokens": 4, "temperature": 0, "return_token_ids": True,
        "messages": [{"role": "user", "content": "héllo there"}]}

served = served_fixture("--body-timeout-s", str(BODY_TIMEOUT_S), "--log-level", "INFO", client_timeout_s=120)


def padded(body: dict, size: int = DIRECT_BODY_BYTES + 12345) -> bytes:
    """The body's JSON with whitespace after its opening brace: `size` bytes or more, the same request."""
    data = json.dumps(body).encode()
    return data[:1] + b" " * max(0, size - len(data)) + data[1:]


def head(path: str, content_length: int, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {content_length}\r\n").encode() + extra + b"\r\n"


def read_until_closed(sock: socket.socket, limit_s: float = 60.0) -> bytes:
    sock.settimeout(limit_s)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text


def test_body_past_h11_gets_the_same_answer_as_a_small_one_and_closes_the_connection(http):
    small = http.post("/v1/chat/completions", json=CHAT)
    assert small.status_code == 200 and small.headers.get("connection") != "close"
    large = http.post("/v1/chat/completions", content=padded(CHAT), headers={"content-type": "application/json"})
    assert large.status_code == 200, large.text
    assert large.headers["connection"] == "close"
    assert large.json()["choices"] == small.json()["choices"]
    assert_still_serving(http)  # (the client opens a new connection)


def test_body_just_under_the_threshold_keeps_the_connection(http):
    r = http.post("/v1/chat/completions", content=padded(CHAT, DIRECT_BODY_BYTES - 1),
                  headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.headers.get("connection") != "close"


def test_request_pipelined_after_a_body_past_h11_is_dropped_and_the_connection_closed(server, http):
    body = padded(CHAT)
    with connect(server.base_url) as sock:
        sock.sendall(head("/v1/chat/completions", len(body)) + body + head("/v1/chat/completions", 2) + b"{}")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1  # the second request was never read as one
    assert_still_serving(http)


def test_body_past_h11_that_stops_short_gets_408(server, http):
    body = padded(CHAT)
    with connect(server.base_url) as sock:
        sock.sendall(head("/v1/chat/completions", len(body)) + body[:-1000])
        started = time.monotonic()
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert time.monotonic() - started < 30
    assert_still_serving(http)


def test_client_vanishing_in_the_middle_of_a_body_past_h11_leaves_the_server_serving(server, http):
    body = padded(CHAT, 4 * DIRECT_BODY_BYTES)
    for _ in range(3):
        with connect(server.base_url) as sock:
            sock.sendall(head("/v1/chat/completions", len(body)) + body[:len(body) // 2])
    assert_still_serving(http)
    assert http.get("/health").status_code == 200


def test_body_past_h11_after_expect_100_continue_is_answered(server):
    body = padded(CHAT)  # (curl sends Expect: 100-continue with a body this large)
    with connect(server.base_url) as sock:
        sock.sendall(head("/v1/chat/completions", len(body), b"expect: 100-continue\r\n"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")
        sock.sendall(body)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_chunked_body_with_a_large_content_length_goes_through_h11(server):
    """Transfer-Encoding wins over Content-Length (RFC 9112): such a body is never read past h11."""
    data = json.dumps(CHAT).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    with connect(server.base_url) as sock:  # (the head alone first: the server decides before any body byte)
        sock.sendall(head("/v1/chat/completions", 4 * DIRECT_BODY_BYTES,
                          b"transfer-encoding: chunked\r\nexpect: 100-continue\r\n"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")
        sock.sendall(chunked + b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert answer.count(b"HTTP/1.1 200 ") == 2  # the chat, then /health on the same connection


def test_bytes_sent_after_a_body_past_h11_do_not_end_its_answer_as_a_disconnect(server, http):
    """More bytes after a large body (a pipelined request, garbage), sent while the answer is being
    generated: dropped, never read as a request, and not taken for the client leaving (which the server
    waits for while it generates: a 499); the whole answer comes, then the connection closes."""
    body = padded({**CHAT, "max_tokens": 200, "ignore_eos": True})
    with connect(server.base_url) as sock:
        sock.sendall(head("/v1/chat/completions", len(body)) + body)
        time.sleep(0.3)  # the body has been taken: these bytes come after its end, in a read of their own
        with contextlib.suppress(OSError):  # (a machine fast enough to have answered already closed the socket)
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 200
    assert_still_serving(http)
