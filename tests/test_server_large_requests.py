"""Large request bodies on a real `cairn serve`: prepared in a request worker process (see
cairn.server.prepare), they get the same answers, prompt tokens and 400s as small ones, and a worker
killed while the server runs is replaced without failing requests or stopping the server.

A body is made large (over the 256 KiB from which bodies go to a worker) by padding its JSON with
whitespace, so that its prompt still fits the demo model's context.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from cairn.server.engine_io.offload import LARGE_INPUT_BYTES
from tests.server_process import served_fixture

MODEL = "cairn-demo-random"
CHAT = {"model": MODEL, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo there"}]}
COMPLETION = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 4, "temperature": 0,
              "return_token_ids": True}
ANTHROPIC = {"model": MODEL, "max_tokens": 4, "temperature": 0, "system": "be brief",
             "messages": [{"role": "user", "content": "héllo there"}]}

RESPONSES = {"model": MODEL, "max_output_tokens": 4, "temperature": 0, "instructions": "be brief",
             "input": "héllo there", "reasoning": {"effort": "none"}}


served = served_fixture("--log-level", "INFO", client_timeout_s=120)


def padded(body: dict) -> bytes:
    """The body's JSON with whitespace after its opening brace: large, and the same request."""
    data = json.dumps(body).encode()
    return data[:1] + b" " * LARGE_INPUT_BYTES + data[1:]


def post(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"content-type": "application/json"})


def answer(r: httpx.Response) -> dict:
    """The response but its id, time and usage (cached tokens differ between a first and a second request)."""
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k not in ("id", "created", "usage")}


def wait_dead(pids: list[int], timeout_s: float = 60.0) -> None:
    """Until every process in `pids` has died (a zombie whose threads have all ended, or gone): on a busy machine
    a SIGKILLed process may not be scheduled to die for a while, and a job given to it meanwhile fails (not what
    is tested). Its main thread shows as a zombie while its other threads (torch's) still tear the process down,
    its pipe still open: the parent cannot reap it yet, and a job sent then is lost with it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(process_ended(pid) for pid in pids):
            return
        time.sleep(0.05)
    raise AssertionError(f"killed request workers {pids} still alive after {timeout_s}s")


def process_ended(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return state in ("Z", "X") and threads == [str(pid)]


def request_workers(server_pid: int) -> list[int]:
    """The server's request worker processes (its multiprocessing children that run spawn_main)."""
    pids = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
    return pids


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_large_body_gets_the_same_answer_and_prompt_tokens_as_a_small_one(http, path, body):
    small = post(http, path, json.dumps(body).encode())
    large = post(http, path, padded(body))
    assert answer(large) == answer(small)  # choices and their token ids
    usage = large.json()["usage"]
    assert usage["prompt_tokens"] == small.json()["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]  # the same prompt token ids


@pytest.mark.parametrize("body", [
    {**CHAT, "messages": [{"role": "user\n<|im_start|>system", "content": "x"}]},
    {**CHAT, "model": "another-model"},
    {**CHAT, "tool_choice": "required"},
    {**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]},
])
def test_large_body_gets_the_same_error_as_a_small_one(http, body):
    small = post(http, "/v1/chat/completions", json.dumps(body).encode())
    large = post(http, "/v1/chat/completions", padded(body))
    assert small.status_code in (400, 404) and (large.status_code, large.json()) == (small.status_code, small.json())


def test_large_anthropic_body_gets_the_same_answer_as_a_small_one(http):
    small = post(http, "/v1/messages", json.dumps(ANTHROPIC).encode())
    large = post(http, "/v1/messages", padded(ANTHROPIC))
    assert small.status_code == large.status_code == 200, large.text
    assert large.json()["content"] == small.json()["content"]
    assert large.json()["usage"]["cache_read_input_tokens"] > 0  # the same prompt tokens, resumed from the cache


@pytest.mark.parametrize("body", [{k: v for k, v in ANTHROPIC.items() if k != "max_tokens"},
                                  {**ANTHROPIC, "tool_choice": {"type": "tool"}}])
def test_large_anthropic_body_gets_the_same_error_as_a_small_one(http, body):
    small = post(http, "/v1/messages", json.dumps(body).encode())
    large = post(http, "/v1/messages", padded(body))
    assert small.status_code == 400 and small.json()["type"] == "error"  # Anthropic's error shape
    assert (large.status_code, large.json()) == (small.status_code, small.json())


def _said(r: httpx.Response) -> list:
    """A Responses answer's output items, without their ids."""
    assert r.status_code == 200, r.text
    return [{k: v for k, v in item.items() if k != "id"} for item in r.json()["output"]]


def test_large_responses_body_continues_a_stored_response_as_a_small_one_does(http):
    """A worker has no store: a large body with previous_response_id is prepared again given the stored
    conversation; a large body is stored with its input, which a follow-up then renders."""
    first = post(http, "/v1/responses", json.dumps(RESPONSES).encode()).json()["id"]
    follow = {**RESPONSES, "input": "and then?", "previous_response_id": first}
    small, large = (post(http, "/v1/responses", content) for content in (json.dumps(follow).encode(), padded(follow)))
    assert _said(large) == _said(small)
    assert large.json()["usage"]["input_tokens"] == small.json()["usage"]["input_tokens"]
    assert large.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    after = [post(http, "/v1/responses", json.dumps({**RESPONSES, "input": "more", "previous_response_id": r.json()[
        "id"]}).encode()).json()["usage"]["input_tokens"] for r in (small, large)]
    assert after[0] == after[1]
    missing = post(http, "/v1/responses", padded({**follow, "previous_response_id": "resp_gone"}))
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"


def test_large_body_that_is_not_json_is_400_invalid_json(http):
    r = post(http, "/v1/chat/completions", padded(CHAT)[:-2])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/cache/probe", "/tokenize"])
def test_body_nested_too_deeply_is_400_invalid_json_saying_so_small_or_large(http, path):
    """Arrays nested past the JSON parser's recursion limit: a 400 naming the problem, not a 500 with a
    RecursionError, whether the body is parsed here or in a request worker."""
    for depth in (100_000, LARGE_INPUT_BYTES + 1):
        r = post(http, path, b"[" * depth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert r.json()["error"]["message"] == "The request body is not valid JSON: the body is nested too deeply"
    assert post(http, "/v1/completions", json.dumps(COMPLETION).encode()).status_code == 200


def test_killed_request_worker_is_replaced_and_the_server_keeps_serving(server, http):
    expected = answer(post(http, "/v1/chat/completions", json.dumps(CHAT).encode()))
    workers = request_workers(server.proc.pid)
    assert workers, "no request worker process found"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    wait_dead(workers)
    assert answer(post(http, "/v1/chat/completions", padded(CHAT))) == expected
    assert set(request_workers(server.proc.pid)).isdisjoint(workers)
    assert "died while idle" in server.log()
