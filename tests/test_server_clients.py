"""Slow, vanishing and too many clients against a real `cairn serve` process (raw sockets where the
client misbehaves below HTTP): each is answered or cut off, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from tests.server_process import served_fixture

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 6


served = served_fixture("--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
                        "--max-connections", str(MAX_CONNECTIONS), "--log-level", "INFO")


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.settimeout(0.25)
    return sock


def trickle_until_answered(sock: socket.socket, data: bytes, every_s: float, limit_s: float = 30.0) -> bytes:
    """Send `data` one byte per `every_s` seconds; return what the server answers before it closes."""
    answer, i = b"", 0
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if i < len(data):
            try:
                sock.sendall(data[i:i + 1])
                i += 1
            except OSError:  # the server closed its end
                break
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            time.sleep(max(0.0, every_s - 0.25))
            continue
        except OSError:
            break
        if not chunk:
            break
        answer += chunk
    return answer


def status_and_code(answer: bytes) -> tuple[int, str | None]:
    head, _, body = answer.partition(b"\r\n\r\n")
    code = re.search(rb'"code": ?"([a-z_]+)"', body)
    return int(head.split(b" ")[1]), code.group(1).decode() if code else None


def requests_total(server, endpoint: str, status: int) -> float:
    m = re.search(rf'^cairn_requests_total{{endpoint="{re.escape(endpoint)}",status="{status}"}} (\S+)$',
                  httpx.get(server.base_url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def assert_still_serving(server) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "ok", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_request_head_trickled_byte_by_byte_gets_408_and_is_closed(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: [::1]\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 200
    with connect(server.base_url) as sock:
        answer = trickle_until_answered(sock, head, every_s=0.3)
    assert status_and_code(answer) == (408, "request_timeout"), answer
    assert_still_serving(server)


def test_connection_that_never_sends_a_request_is_closed(server):
    with connect(server.base_url) as sock:
        answer = trickle_until_answered(sock, b"", every_s=0.3)
    assert status_and_code(answer) == (408, "request_timeout"), answer


def test_body_trickled_at_one_byte_per_half_second_gets_408(server):
    body = b'{"prompt": "slow", "max_tokens": 1}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with connect(server.base_url) as sock:
        sock.sendall(head)
        answer = trickle_until_answered(sock, body, every_s=0.5)
    assert status_and_code(answer) == (408, "request_timeout"), answer
    assert_still_serving(server)


def test_connections_over_the_cap_get_503_and_the_server_recovers(server):
    socks = [connect(server.base_url) for _ in range(MAX_CONNECTIONS + 1)]
    try:
        last = trickle_until_answered(socks[-1], b"", every_s=0.1, limit_s=HEADER_TIMEOUT_S / 2)
    finally:
        for s in socks:
            s.close()
    assert status_and_code(last) == (503, "too_many_connections"), last
    assert_still_serving(server)


def test_an_asyncio_client_over_the_connection_cap_reads_its_503(server):
    """An asyncio client (httpx.AsyncClient, AsyncOpenAI) sends its request before it reads, and stops reading
    once a send fails: a refusal that closed the connection with that request unread (or arriving after the
    close) answered it with a reset, and the client saw a broken connection instead of the 503."""

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as client:
            return await client.post(server.base_url + "/v1/completions", json={"prompt": "over", "max_tokens": 1})

    socks = [connect(server.base_url) for _ in range(MAX_CONNECTIONS)]
    try:
        answer = asyncio.run(post())
    finally:
        for s in socks:
            s.close()
    assert (answer.status_code, answer.json()["error"]["code"]) == (503, "too_many_connections"), answer.text
    assert_still_serving(server)


def test_client_dropping_a_whole_response_is_499_without_a_traceback(server):
    before = requests_total(server, "/v1/completions", 499)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json={"prompt": "gone", "max_tokens": 2000, "ignore_eos": True},
                   timeout=1.0)
    deadline = time.monotonic() + 30
    while requests_total(server, "/v1/completions", 499) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests_total(server, "/v1/completions", 499) == before + 1
    assert requests_total(server, "/v1/completions", 500) == 0
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert "the client closed the connection" in log
    assert re.search(r'^cairn_num_requests_running 0', httpx.get(server.base_url + "/metrics").text, re.M)


def test_client_dropping_a_stream_is_499_in_the_access_log_and_metrics(server):
    """The stream's 200 went out with its first event; the client leaving before `[DONE]` is still what
    the access log and cairn_requests_total report: 499, as for a whole answer it did not wait for."""
    before = requests_total(server, "/v1/completions", 499)
    body = {"prompt": "gone", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")  # then the connection is closed, mid-stream
    deadline = time.monotonic() + 30
    while requests_total(server, "/v1/completions", 499) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests_total(server, "/v1/completions", 499) == before + 1
    assert re.search(r"POST /v1/completions 499 ", server.log()), server.log()
    assert_still_serving(server)


def test_client_not_reading_the_last_answer_of_its_connection_gets_nothing_after_it(server):
    """A large answer on a connection the client closes (`Connection: close`), which it leaves unread: the
    server has handed the whole answer to the transport, which closes once the client reads it. The head
    deadline, armed when the answer completes, finds the connection closing and adds no 408 to the answer."""
    body = json.dumps({"prompt": "a" * 2_000_000}).encode()  # /tokenize answers about 8 MB of token ids
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window stays small)
        sock.settimeout(30)
        sock.connect((host, int(port)))
        before, log_before = requests_total(server, "/tokenize", 200), len(server.log())
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 60
        while requests_total(server, "/tokenize", 200) == before:  # the answer is complete on the server's side
            assert time.monotonic() < deadline, "the answer never completed"
            time.sleep(0.1)
        time.sleep(2 * HEADER_TIMEOUT_S)  # the head deadline passes while the answer waits to be read
        answer = b""
        while chunk := sock.recv(1 << 20):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    assert len(payload) == length, payload[length:length + 200]  # nothing after the answer
    assert json.loads(payload)["count"] == 2_000_000
    assert "no complete request head" not in server.log()[log_before:]
