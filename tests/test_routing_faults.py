"""A real `cairn router` process against replicas that fail on cue (tests/scripted_replica.py).

Each test starts the router over scripted replicas and checks what its client sees and what the router's
/health reports: probes that are missing, garbage or late leave the replica in and route by order; a 503,
a refused connection or a drop before the first byte moves the request to the next replica and takes the
failed one out; with every replica failing the client gets the last answer or a 503 `no_replica`; a drop
mid-stream ends the SSE stream with an error event; a replica whose /health answers again is back; a large
chat body is parsed off the event loop and its prefixes remembered; a body that is not JSON is passed on.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from cairn.router.app import MAX_HELD_ANSWER_BYTES, Router
from cairn.router.options import RouterOptions
from tests.scripted_replica import BUSY_PADDING, Script, ScriptedReplica
from tests.server_process import ServerProcess, start_router


@contextmanager
def routed(*scripts: Script):
    """(router, [replicas]) over one scripted replica per script; a failed replica stays out for 60 s."""
    with ExitStack() as stack:
        replicas = [stack.enter_context(ScriptedReplica(s)) for s in scripts]
        flags = [f for r in replicas for f in ("--replica", r.url)]
        router = start_router(*flags, "--cooldown-s", "60", "--health-interval-s", "0.2", "--probe-timeout-s", "0.5")
        stack.callback(router.stop)  # before the replicas stop
        yield router, replicas


def chat(router: ServerProcess, content: str = "hello", **body) -> httpx.Response:
    return httpx.post(router.base_url + "/v1/chat/completions", timeout=30,
                      json={"model": "scripted", "messages": [{"role": "user", "content": content}], **body})


def health(router: ServerProcess) -> dict:
    return httpx.get(router.base_url + "/health", timeout=10).json()


def replica_report(router: ServerProcess, replica: ScriptedReplica) -> dict:
    return next(r for r in health(router)["replicas"] if r["url"] == replica.url)


def test_probes_that_are_missing_garbage_or_late_leave_the_replicas_in():
    scripts = Script(probe="missing"), Script(probe="garbage"), Script(probe="slow")
    with routed(*scripts) as (router, replicas):
        for i in range(3):
            resp = chat(router, f"question {i}")  # a new conversation each time: probed, not placed
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "scripted"
            assert resp.headers["x-cairn-replica"] in {r.url for r in replicas}
        report = health(router)
        assert report["routed_by"] == {"probe": 3}
        assert all(r["healthy"] and r["failed"] == 0 for r in report["replicas"])


def test_a_replica_answering_503_passes_the_request_to_the_next_and_is_taken_out():
    with routed(Script(answer="busy"), Script(probe="missing")) as (router, (busy, ok)):
        resp = chat(router)  # the busy one answered its probe: it is tried first
        assert resp.status_code == 200 and resp.headers["x-cairn-replica"] == ok.url
        assert busy.script.generations == ["/v1/chat/completions"]
        report = replica_report(router, busy)
        assert not report["healthy"] and report["failed"] == 1 and report["last_error"] == "answered 503"


def test_a_replica_dropping_before_the_first_byte_passes_the_request_to_the_next():
    with routed(Script(answer="cut_before_body"), Script(probe="missing")) as (router, (cut, ok)):
        resp = chat(router)
        assert resp.status_code == 200 and resp.headers["x-cairn-replica"] == ok.url
        assert cut.script.generations == ["/v1/chat/completions"]
        assert "before the first byte" in replica_report(router, cut)["last_error"]


def test_with_every_replica_failing_the_client_gets_the_last_answer_then_a_503():
    with routed(Script(answer="busy"), Script(probe="missing", answer="busy")) as (router, replicas):
        resp = chat(router)
        error = resp.json()["error"]
        assert resp.status_code == 503 and error["message"] == "scripted: busy"  # passed on, whole
        assert error["detail"] == "." * BUSY_PADDING
        assert httpx.get(router.base_url + "/health", timeout=10).status_code == 503  # both taken out
        resp = chat(router, "again")  # none available: every replica is tried anyway, soonest back first
        assert resp.status_code == 503 and health(router)["routed_by"]["none_available"] == 1
        assert [len(r.script.generations) for r in replicas] == [2, 2]
        for r in replicas:
            r.stop()  # connections refused now
        resp = chat(router, "once more")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_replica"
        assert all("ConnectError" in r["last_error"] for r in health(router)["replicas"])  # (or its /health)


def test_a_replica_failing_mid_stream_ends_the_stream_with_an_error_event():
    with routed(Script(answer="cut_mid_stream")) as (router, _):
        resp = chat(router, stream=True)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[0]["choices"][0]["delta"]["content"] == "half"
        assert events[-1]["error"]["message"].startswith("the replica failed mid-stream")


def test_an_anthropic_stream_cut_mid_way_ends_with_an_error_event_in_anthropics_shape():
    with routed(Script(answer="cut_mid_stream")) as (router, (replica,)):
        resp = httpx.post(router.base_url + "/v1/messages", timeout=30, json={
            "model": "scripted", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200 and replica.script.generations == ["/v1/messages"]
        last = resp.text.strip().split("\n\n")[-1].splitlines()
        assert last[0] == "event: error"
        error = json.loads(last[1][len("data: "):])
        assert error["type"] == "error" and error["error"]["message"].startswith("the replica failed mid-stream")


def wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_replica_whose_health_answers_again_is_back():
    with routed(Script(health=503), Script()) as (router, (sick, _)):
        assert wait_for(lambda: not replica_report(router, sick)["healthy"])
        sick.script.health = 200
        assert wait_for(lambda: replica_report(router, sick)["healthy"])


def test_a_large_chat_body_is_routed_and_its_prefixes_remembered():
    with routed(Script()) as (router, (replica,)):
        resp = chat(router, "x" * 300_000)  # over the router's inline-parse limit
        assert resp.status_code == 200 and resp.headers["x-cairn-replica"] == replica.url
        assert health(router)["remembered_prefixes"] > 0


def test_a_body_that_is_not_json_is_passed_on_and_nothing_remembered():
    """The replica answers for a body it cannot read (a real one with a 400); the router only forwards it."""
    with routed(Script()) as (router, (replica,)):
        resp = httpx.post(router.base_url + "/v1/chat/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 200 and replica.script.generations == ["/v1/chat/completions"]
        assert health(router)["remembered_prefixes"] == 0


def test_a_host_that_does_not_name_a_loopback_router_is_a_421_and_its_replicas_still_answer_it():
    """The router sends each replica the replica's own Host (its URL's), so a DNS rebinding page's Host stops at
    the router: it answers 421 itself, and routes what names it."""
    with routed(Script()) as (router, (replica,)):
        port = router.base_url.rsplit(":", 1)[1]
        for path in ("/health", "/v1/models"):
            resp = httpx.get(router.base_url + path, headers={"host": f"evil.example:{port}"}, timeout=30)
            assert resp.status_code == 421 and resp.json()["error"]["code"] == "invalid_host", resp.text
        assert chat(router).status_code == 200 and replica.script.generations == ["/v1/chat/completions"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_router_stopped_by_sigterm_or_ctrl_c_exits_0_as_cairn_serve_does(sig):
    """An operator's SIGTERM (as a supervisor sends) or Ctrl-C ends the router cleanly, status 0, nothing on
    its log but what it logged while serving: uvicorn alone would raise the signal again and die by it (143;
    a KeyboardInterrupt traceback for Ctrl-C)."""
    with ScriptedReplica(Script()) as replica:
        router = start_router("--replica", replica.url)
        assert chat(router).status_code == 200
        router.signal(sig)
        assert router.proc.wait(20) == 0
        assert router.stop() == 0
        assert "Traceback" not in router.log()


def test_models_lists_what_every_replica_serves_each_once():
    """Replicas of different models behind one router: /v1/models listed the first replica's alone, so a
    client choosing a model from it never saw the others (their requests were routed fine)."""
    scripts = Script(models=("qwen", "shared")), Script(models=("nemotron", "shared")), Script(health=503)
    with routed(*scripts) as (router, (_, _, down)):
        deadline = time.monotonic() + 30
        while replica_report(router, down)["healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)  # until the health poll has taken it out
        resp = httpx.get(router.base_url + "/v1/models", timeout=30)
        assert resp.status_code == 200
        assert [m["id"] for m in resp.json()["data"]] == ["qwen", "shared", "nemotron"]
        for name, status in (("nemotron", 200), ("qwen", 200), ("llama", 404)):
            resp = httpx.get(router.base_url + "/v1/models/" + name, timeout=30)
            assert resp.status_code == status and (status != 200 or resp.json()["id"] == name)


CHUNK = b" " * (64 << 10)
ENDLESS_BYTES = 64 << 20  # "never-ending" for the test: 64x what the router may hold


class Endless(httpx.AsyncByteStream):
    """A replica's answer that goes on (ENDLESS_BYTES of it): counts how much of it the router pulled."""

    def __init__(self, head: bytes = b""):
        self.head, self.pulled = head, 0

    async def __aiter__(self):
        yield self.head
        while self.pulled < ENDLESS_BYTES:
            self.pulled += len(CHUNK)
            yield CHUNK


def over_endless_answers(status_of: dict[str, int]) -> tuple[Router, list[Endless]]:
    """A router whose one replica answers every path with `status_of[path]` (default 200) and an endless body
    (a JSON probe answer, padded), in-process (an httpx mock transport: no sockets)."""
    answers: list[Endless] = []

    def answer(request: httpx.Request) -> httpx.Response:
        answers.append(Endless(json.dumps({"position": 96, "est_ttft_s": 0.01}).encode()))
        return httpx.Response(status_of.get(request.url.path, 200), headers={"content-type": "application/json"},
                              stream=answers[-1])

    router = Router(["http://replica"], RouterOptions())
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return router, answers


def test_answers_the_router_reads_whole_are_read_no_further_than_it_may_hold():
    """A replica answering its probe, /health, a model list or a request (with a 503, which the router keeps
    to pass on) with a never-ending body: the router read it all into memory (5 GB in 10 s, still growing after
    the client had gone), as each timeout bounds one read, not the answer."""
    router, answers = over_endless_answers({"/v1/chat/completions": 503})

    async def scenario():
        probe = await router._probe(router.replicas[0], "/v1/cache/probe", b"{}", {})
        await router._check(router.replicas[0])
        models = await router.models_of("/v1/models", {})
        failed = await router.forward("POST", "/v1/chat/completions", b"{}", {}, router.replicas)
        await router.close()
        return probe, models, failed

    probe, models, failed = asyncio.run(scenario())
    assert probe is None and models == []  # too long to be an answer: as if none came
    assert failed.status_code == 503 and json.loads(failed.body)["error"]["code"] == "no_replica"
    assert len(answers) == 4
    assert all(a.pulled <= MAX_HELD_ANSWER_BYTES + len(CHUNK) for a in answers), [a.pulled for a in answers]


def test_a_request_body_over_the_routers_limit_is_413_and_reaches_no_replica():
    """The router read a client's body whole, however long: a never-ending one grew its memory without bound
    (5 GB in 8 s); it is refused past --max-request-bytes now, declared or chunked, in the API's shape."""
    with ScriptedReplica(Script()) as replica:
        router = start_router("--replica", replica.url, "--max-request-bytes", "1000")
        try:
            def chunked():  # no content-length: counted while read
                yield b'{"model": "scripted", "messages": [{"role": "user", "content": "'
                yield b"x" * 2000
                yield b'"}]}'

            for path, body, shape in (("/v1/chat/completions", chunked(), "error"),
                                      ("/v1/messages", b"{" + b" " * 2000 + b"}", "type")):
                resp = httpx.post(router.base_url + path, content=body, timeout=30,
                                  headers={"content-type": "application/json"})
                assert resp.status_code == 413 and shape in resp.json(), resp.text
            assert chat(router).status_code == 200  # a body within the limit is routed
            assert replica.script.generations == ["/v1/chat/completions"]
        finally:
            router.stop()
