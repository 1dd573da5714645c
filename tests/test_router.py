"""`cairn router` in front of two real `cairn serve` replicas on loopback, and its ranking rule.

The replicas are real processes (tests/server_process.py), as is the router; nothing is timed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from cairn.router.replicas import Probe, Ranker, Replica
from tests.server_process import REPO_ROOT, ServerProcess, free_port, openai_client, start_cli, start_server

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly",
         "hex", "every", "jolly", "box")


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


def start_router(*replicas: str) -> ServerProcess:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="cairn-router-", suffix=".log")
    flags = [f for url in replicas for f in ("--replica", url)]
    cmd = [sys.executable, "-m", "cairn.cli", "router", "--port", str(port), *flags, "--cooldown-s", "60",
           "--health-interval-s", "0.2"]
    try:
        proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        os.close(fd)
    router = ServerProcess(proc, f"http://127.0.0.1:{port}", Path(log_path))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cairn router exited with {proc.returncode}:\n{router.log()}")
        try:
            if httpx.get(router.base_url + "/health", timeout=1.0).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    router.stop()
    raise RuntimeError(f"cairn router did not become healthy:\n{router.log()}")


@pytest.fixture(scope="module")
def cluster():
    """(replica A, replica B, router over [A, B]); a test may kill A (it runs last)."""
    a, b = start_server(), start_server()
    router = start_router(a.base_url, b.base_url)
    yield a, b, router
    for p in (router, a, b):
        p.stop()


def chat(base_url: str, messages: list[dict], **kw) -> httpx.Response:
    body = {"model": "cairn-demo-random", "messages": messages, "max_tokens": 6, "temperature": 0, **kw}
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)


def probe(base_url: str, messages: list[dict]) -> dict:
    resp = httpx.post(base_url + "/v1/cache/probe", json={"model": "cairn-demo-random", "messages": messages},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_conversation_goes_back_to_the_replica_that_resumes_it_deepest(cluster):
    a, b, router = cluster
    turn1 = [{"role": "system", "content": text(120, 1)}, {"role": "user", "content": text(60, 2)}]
    first = chat(b.base_url, turn1)  # served by B directly: A never saw it
    assert first.status_code == 200
    turn2 = turn1 + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": text(30, 3)}]
    on_a, on_b = probe(a.base_url, turn2), probe(b.base_url, turn2)
    assert on_a["tokens"] == on_b["tokens"] > 0
    assert on_a["position"] == 0 and on_a["tier"] is None
    assert on_b["position"] > 0 and on_b["tier"] == "device" and on_b["est_ttft_s"] < on_a["est_ttft_s"]
    for _ in range(2):  # the router's round robin would start with A: the probe must override it
        resp = chat(router.base_url, turn2)
        assert resp.status_code == 200
        assert resp.headers["x-cairn-replica"] == b.base_url
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= on_b["position"]


def test_streaming_passes_through_the_router_unchanged(cluster):
    a, _, router = cluster
    messages = [{"role": "user", "content": text(40, 5)}]
    direct = chat(a.base_url, messages).json()["choices"][0]["message"]["content"]
    client = openai_client(router)
    stream = client.chat.completions.create(model="cairn-demo-random", messages=messages, max_tokens=6, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == direct
    assert httpx.get(router.base_url + "/v1/models", timeout=30).json()["data"][0]["id"] == "cairn-demo-random"


def test_a_bad_probe_is_an_openai_error_and_a_completion_prompt_probes_too(cluster):
    a, _, _ = cluster
    bad = httpx.post(a.base_url + "/v1/cache/probe", json={"model": "cairn-demo-random"}, timeout=30)
    assert bad.status_code == 400 and "error" in bad.json()
    unknown = httpx.post(a.base_url + "/v1/cache/probe", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert unknown.status_code == 404
    ids = httpx.post(a.base_url + "/v1/cache/probe", json={"prompt": [5, 6, 7, 8]}, timeout=30).json()
    assert ids["tokens"] == 4 and ids["position"] == 0 and ids["waiting"] == 0


def routed_by(router: ServerProcess) -> dict:
    return httpx.get(router.base_url + "/health", timeout=30).json()["routed_by"]


def reply_and_ask(messages: list[dict], resp: httpx.Response, seed: int) -> list[dict]:
    reply = resp.json()["choices"][0]["message"]["content"]
    return messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": text(20, seed)}]


def test_a_conversations_next_turn_goes_back_unprobed_to_the_replica_that_served_it(cluster):
    _, _, router = cluster
    turn1 = [{"role": "system", "content": text(100, 30)}, {"role": "user", "content": text(50, 31)}]
    before = routed_by(router)
    first = chat(router.base_url, turn1)
    assert first.status_code == 200
    probed = routed_by(router)
    assert probed["probe"] == before.get("probe", 0) + 1  # nothing of it was known: the replicas were asked
    second = chat(router.base_url, reply_and_ask(turn1, first, 32))
    assert second.status_code == 200
    assert second.headers["x-cairn-replica"] == first.headers["x-cairn-replica"]
    after = routed_by(router)
    assert after["probe"] == probed["probe"] and after.get("placement", 0) == probed.get("placement", 0) + 1
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"]


def test_a_placed_replica_that_is_busier_than_the_others_is_probed_and_loses_to_the_queue(cluster):
    _, _, router = cluster
    turn1 = [{"role": "user", "content": text(60, 40)}]
    first = chat(router.base_url, turn1)
    placed_on = first.headers["x-cairn-replica"]
    long = {"model": "cairn-demo-random", "messages": reply_and_ask(turn1, first, 41), "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    url = router.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=long, timeout=60) as s1, httpx.stream("POST", url, json=long, timeout=60) as s2:
        assert s1.headers["x-cairn-replica"] == s2.headers["x-cairn-replica"] == placed_on  # one more in flight is fine
        before = routed_by(router)
        third = chat(router.base_url, reply_and_ask(turn1, first, 42))
        assert third.status_code == 200
        assert routed_by(router)["probe"] == before["probe"] + 1
        assert third.headers["x-cairn-replica"] != placed_on  # two requests running there outweigh its cache


def aborted(base_url: str) -> float:
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('cairn_requests_finished_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_leaving_a_stream_through_the_router_aborts_it_on_the_replica(cluster):
    _, _, router = cluster
    body = {"model": "cairn-demo-random", "messages": [{"role": "user", "content": text(10, 20)}], "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        replica = resp.headers["x-cairn-replica"]
        before = aborted(replica)
        next(resp.iter_lines())  # the stream has started; leave
    deadline = time.monotonic() + 60
    while aborted(replica) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborted(replica) == before + 1


def anthropic_client(router: ServerProcess):
    import anthropic

    return anthropic.Anthropic(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)


def test_an_anthropic_conversation_is_routed_and_its_next_turn_goes_back_to_its_replica(cluster):
    """/v1/messages (and count_tokens) were not routed at all: an Anthropic agent behind the router got 404s."""
    _, _, router = cluster
    claude = anthropic_client(router)
    system, turn1 = text(100, 50), [{"role": "user", "content": text(50, 51)}]
    probed = routed_by(router).get("probe", 0)
    first = claude.messages.with_raw_response.create(model="cairn-demo-random", system=system, messages=turn1,
                                                     max_tokens=6)
    assert routed_by(router)["probe"] == probed + 1  # a new conversation: probed (/v1/cache/probe/messages)
    answer = first.parse()
    turn2 = turn1 + [{"role": "assistant", "content": answer.content[0].text or "ok"},
                     {"role": "user", "content": text(20, 52)}]
    counted = claude.messages.count_tokens(model="cairn-demo-random", system=system, messages=turn2).input_tokens
    with claude.messages.stream(model="cairn-demo-random", system=system, messages=turn2, max_tokens=6) as stream:
        second = stream.get_final_message()
        replica = stream.response.headers["x-cairn-replica"]
    assert replica == first.headers["x-cairn-replica"]  # placed: its prefix keys are known
    usage = second.usage
    assert usage.cache_read_input_tokens >= answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == counted


def test_the_messages_probe_tokenizes_a_messages_body_as_count_tokens_does(cluster):
    a, _, _ = cluster
    body = {"model": "cairn-demo-random", "system": text(30, 60), "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text(10, 61)}]}]}
    probed = httpx.post(a.base_url + "/v1/cache/probe/messages", json=body, timeout=60)
    counted = httpx.post(a.base_url + "/v1/messages/count_tokens", timeout=60,
                         json={k: v for k, v in body.items() if k != "max_tokens"})
    assert probed.status_code == 200 and probed.json()["tokens"] == counted.json()["input_tokens"]
    bad = httpx.post(a.base_url + "/v1/cache/probe/messages", json={"model": "cairn-demo-random"}, timeout=60)
    assert bad.status_code == 400


def test_a_responses_conversation_goes_back_to_the_replica_that_stores_it(cluster):
    """A response's follow-up (previous_response_id) and its GET / DELETE reach the replica storing it: through
    the router's memory of who answered it, or, for one stored where this router did not see it, through the
    probe (which only that replica answers)."""
    a, b, router = cluster
    ask = {"model": "cairn-demo-random", "max_output_tokens": 4, "temperature": 0, "reasoning": {"effort": "none"}}
    first = httpx.post(router.base_url + "/v1/responses", json={"input": text(80, 21), **ask}, timeout=120)
    assert first.status_code == 200, first.text
    holder, first_id = first.headers["x-cairn-replica"], first.json()["id"]
    routed = httpx.get(router.base_url + "/health").json()["routed_by"].get("response_holder", 0)
    for _ in range(2):
        again = httpx.post(router.base_url + "/v1/responses", timeout=120,
                           json={"input": "and then?", "previous_response_id": first_id, **ask})
        assert again.status_code == 200 and again.headers["x-cairn-replica"] == holder, again.text
        assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert httpx.get(router.base_url + "/health").json()["routed_by"]["response_holder"] == routed + 2  # unprobed
    got = httpx.get(router.base_url + f"/v1/responses/{first_id}", timeout=60)
    assert got.status_code == 200 and got.json()["id"] == first_id and got.headers["x-cairn-replica"] == holder
    unseen = httpx.post(b.base_url + "/v1/responses", json={"input": text(80, 22), **ask}, timeout=120).json()["id"]
    follow = httpx.post(router.base_url + "/v1/responses", timeout=120,
                        json={"input": "and then?", "previous_response_id": unseen, **ask})
    assert follow.status_code == 200 and follow.headers["x-cairn-replica"] == b.base_url, follow.text
    assert httpx.delete(router.base_url + f"/v1/responses/{first_id}", timeout=60).status_code == 200
    assert httpx.get(router.base_url + f"/v1/responses/{first_id}", timeout=60).status_code == 404


def test_the_router_says_where_it_listens_and_writes_no_line_per_health_poll(cluster):
    """Its one start-up line names the replicas and the address, as `cairn serve`'s does; the /health polls (every
    0.2 s here) and the requests it forwards write no httpx line at the default level."""
    a, b, router = cluster
    assert f"routing to 2 replica(s) ({a.base_url}, {b.base_url}) on {router.base_url}" in router.log()
    assert "httpx" not in router.log()


def test_the_router_closes_a_trickled_request_head_with_408_and_connections_over_its_cap_with_503(cluster):
    """The router ran on uvicorn's plain protocol: a client trickling its headers held a connection as long as
    it liked, and connections had no cap. It now has `cairn serve`'s guards (--header-timeout-s,
    --max-connections)."""
    from tests.test_server_clients import connect, status_and_code, trickle_until_answered

    _, b, _ = cluster
    router = start_cli("router", "--replica", b.base_url, "--header-timeout-s", "1", "--max-connections", "3",
                       timeout_s=60)
    try:
        with connect(router.base_url) as sock:
            answer = trickle_until_answered(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100,
                                            every_s=0.3)
        assert status_and_code(answer) == (408, "request_timeout"), answer
        socks = [connect(router.base_url) for _ in range(4)]
        try:
            last = trickle_until_answered(socks[-1], b"", every_s=0.1, limit_s=0.5)
        finally:
            for sock in socks:
                sock.close()
        assert status_and_code(last) == (503, "too_many_connections"), last
        assert httpx.get(router.base_url + "/health", timeout=10).status_code == 200
    finally:
        router.stop()


def test_a_killed_replicas_requests_go_to_the_other(cluster):
    a, b, router = cluster
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    for i in range(4):
        resp = chat(router.base_url, [{"role": "user", "content": text(20, 10 + i)}], stream=i % 2 == 1)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-cairn-replica"] == b.base_url
    health = httpx.get(router.base_url + "/health", timeout=10).json()
    assert [r["healthy"] for r in health["replicas"]] == [False, True]


# ---- the ranking rule (pure) ----------------------------------------------------------------------

def replicas(n: int) -> list[Replica]:
    return [Replica(f"http://r{i}") for i in range(n)]


def test_cold_requests_spread_round_robin():
    ranker, rs = Ranker(queue_cost_s=0.5), replicas(3)
    cold = {r.url: Probe(0, 0.100, 0, 0) for r in rs}
    firsts = [ranker.rank(rs, cold)[0].url for _ in range(6)]
    assert firsts == ["http://r0", "http://r1", "http://r2"] * 2


def test_the_deeper_resume_wins_among_close_estimates_and_the_queue_outweighs_it():
    ranker, (r0, r1) = Ranker(queue_cost_s=0.5), replicas(2)
    close = {r0.url: Probe(0, 0.100, 0, 0), r1.url: Probe(64, 0.095, 0, 0)}
    assert ranker.rank([r0, r1], close) == [r1, r0]
    busy = {r0.url: Probe(0, 0.100, 0, 0), r1.url: Probe(64, 0.095, 3, 1)}
    assert ranker.rank([r0, r1], busy) == [r0, r1]


def test_replicas_that_did_not_answer_the_probe_come_last():
    ranker, (r0, r1) = Ranker(queue_cost_s=0.5), replicas(2)
    assert ranker.rank([r0, r1], {r0.url: None, r1.url: Probe(0, 5.0, 10, 2)}) == [r1, r0]


@pytest.mark.parametrize("argv,message", [(["router"], "at least one --replica"),
                                          (["router", "--replica", "127.0.0.1:8000"], "http:// or https://")])
def test_router_flags_mistakes_are_one_line_errors(argv, message, capsys):
    from cairn.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_router_passes_either_api_key_header_to_the_replica():
    """A replica with --api-key takes `Authorization: Bearer KEY` or `x-api-key: KEY`: both reach it."""
    from starlette.requests import Request

    from cairn.router.app import _request_headers

    scope = {"type": "http", "headers": [(b"authorization", b"Bearer k"), (b"x-api-key", b"k"), (b"cookie", b"c")]}
    assert _request_headers(Request(scope)) == {"authorization": "Bearer k", "x-api-key": "k"}
