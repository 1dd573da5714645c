"""Two real `cairn serve` replicas on one real redis-server: an agentic conversation moves between them.

Replica A serves a turn and writes its segments to Redis behind the request; replica B, which never saw
the conversation, is probed (POST /v1/cache/probe reports what Redis holds for it) and then serves the
next turn, resuming from Redis. The reference is B itself with `cache_prompt: false` (a cold prefill).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.redis_server import replicas_on_redis

# An agentic session as coding agents send it: a long system prompt with tool descriptions, a task, tool
# calls and their (long) results. The demo model's tokenizer is byte-level, so a turn's template and new
# message cost ~60-100 tokens (and a resume point lands on a 64-token block below the previous prompt's
# end): the conversation before the new turn must be long (~3,000 tokens) for 95% of it to be resumable,
# as it is in a real agentic session (tens of thousands of tokens before each short tool result).
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "description": "file path, relative"}},
    "required": ["path"]}}} for name, desc in [
        ("read_file", "Read a file of the repository and return its text, with line numbers."),
        ("list_dir", "List the entries of a directory of the repository, one per line."),
        ("run_tests", "Run the test suite of the repository and return the report of the failures.")]]
SYSTEM = ("You are a careful software engineer working in a repository. Use the tools to read files and run "
          "the tests before you change anything; explain each change in one sentence. ") * 4
SOURCE = "\n".join(f"{i:4d}  def handler_{i}(request):\n        return respond(request, status={200 + i % 7})"
                   for i in range(24))

FAILURES = "FAILED tests/test_handlers.py::test_status - 201 != 200\n" * 12


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "The request handlers return the wrong status. Find the bug and fix it."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "read_file", "arguments": json.dumps({"path": "server/handlers.py"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": SOURCE},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_2", "type": "function", "function": {
            "name": "run_tests", "arguments": json.dumps({"path": "tests"})}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": FAILURES},
    ]


@pytest.fixture(scope="module")
def replicas():
    with replicas_on_redis() as servers:
        yield servers


def chat(base_url: str, messages: list[dict], **kw) -> dict:
    body = {"model": "cairn-demo-random", "messages": messages, "tools": TOOLS, "max_tokens": 12, "temperature": 0,
            "logprobs": True, **kw}
    resp = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def probe(base_url: str, messages: list[dict]) -> dict:
    body = {"model": "cairn-demo-random", "messages": messages, "tools": TOOLS}
    resp = httpx.post(base_url + "/v1/cache/probe", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def written(base_url: str) -> float:
    """Segments the replica wrote to Redis (its write-behind is done when this stops growing)."""
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("cairn_cache_num_remote_segments"):
            return float(line.split()[-1])
    return 0.0


def settle(base_url: str) -> None:
    last, deadline = -1.0, time.monotonic() + 30
    while time.monotonic() < deadline:
        now = written(base_url)
        if now == last and now > 0:
            return
        last = now
        time.sleep(0.5)


def test_an_agentic_conversation_served_on_a_continues_on_b_from_redis_as_cold(replicas):
    a, b = replicas
    turn = conversation()
    first = chat(a.base_url, turn)
    settle(a.base_url)
    reply = first["choices"][0]["message"]
    turn2 = turn + [{"role": "assistant", "content": reply["content"] or ""},
                    {"role": "user", "content": "Fix it."}]
    on_b = probe(b.base_url, turn2)  # B never saw the conversation: the probe asks Redis
    assert on_b["remote_position"] >= 0.95 * on_b["tokens"], on_b
    assert on_b["tier"] == "remote" and on_b["position"] == on_b["remote_position"]
    warm = chat(b.base_url, turn2)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * warm["usage"]["prompt_tokens"], warm["usage"]
    cold = chat(b.base_url, turn2, cache_prompt=False)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    pairs = zip(warm["choices"][0]["logprobs"]["content"], cold["choices"][0]["logprobs"]["content"], strict=True)
    assert max(abs(w["logprob"] - c["logprob"]) for w, c in pairs) < 1e-3
