"""What real agent clients sent, replayed against a real `cairn serve`: the Codex CLI's requests to /v1/responses
and Claude Code's to /v1/messages.

The fixtures in tests/fixtures/agent_requests/ are the bodies the clients sent to cairn's demo server: every
field, message and tool as sent, long texts cut to 240 characters, ids and paths replaced.
- codex_*: codex-cli 0.171.0 (`codex exec`, then `codex exec resume --last`: one session of two turns), a custom
  model provider with `wire_api = "responses"` and `web_search = "disabled"`.
- claude_code_*: Claude Code 2.1.197 (`claude -p`, ANTHROPIC_BASE_URL at the server): its default turn (24 tools,
  a system message after the user's; whole, 77k of the demo's byte tokens, over its 65,536-token context) and
  one with `--tools Bash,Read --system-prompt ...` (answered whole by the demo server).
Each is replayed streamed, as the client sent it, with the output limit lowered (the demo model's answers are
random text that would otherwise run long).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cairn.config import RANDOM_DEMO_NAME
from tests.server_process import served_fixture

FIXTURES = Path(__file__).parent / "fixtures" / "agent_requests"
OUTPUT_TOKENS = 8
FORCED_OUTPUT_TOKENS = 256

served = served_fixture("--max-model-len", "32768", "--max-num-seqs", "2", "--log-level", "WARNING")


def sent(name: str) -> dict:
    """The body as the client sent it, to the model the tests serve (the clients were pointed at `cairn-demo`)."""
    return {**json.loads((FIXTURES / name).read_text()), "model": RANDOM_DEMO_NAME}


def streamed(http, body: dict) -> list[dict]:
    """The events of a streamed /v1/responses answer (each `event:` line's type checked against its data)."""
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    kinds, events = lines[0::2], [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert kinds == [f"event: {e['type']}" for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def finished(events: list[dict]) -> dict:
    """The whole response the last event carries, checked to be the end of a well-formed stream."""
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete"), final
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    response = final["response"]
    assert added == [item["id"] for item in done] == [item["id"] for item in response["output"]]
    assert response["usage"]["input_tokens"] > 0 and response["usage"]["output_tokens"] > 0
    return response


@pytest.mark.parametrize("name", ["codex_first_turn.json", "codex_second_turn.json"])
def test_the_codex_clis_turns_are_answered_as_a_complete_stream(http, name):
    """Its namespace tool (multi_agent_v1) and client_metadata were 400s before."""
    body = {**sent(name), "max_output_tokens": OUTPUT_TOKENS}
    assert any(t["type"] == "namespace" for t in body["tools"]) and "client_metadata" in body
    response = finished(streamed(http, body))
    assert response["store"] is False and response["usage"]["output_tokens"] <= OUTPUT_TOKENS


def test_the_codex_clis_second_turn_resumes_its_first_from_the_cache(http):
    """Codex sends the whole conversation each turn (store false): the second turn's prompt extends the first's."""
    first = finished(streamed(http, {**sent("codex_first_turn.json"), "max_output_tokens": OUTPUT_TOKENS}))
    second = finished(streamed(http, {**sent("codex_second_turn.json"), "max_output_tokens": OUTPUT_TOKENS}))
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]


def test_a_call_of_a_namespace_tool_comes_back_with_its_namespace_and_goes_back_as_sent(http):
    """A call forced to the namespace's function `multi_agent_v1.spawn_agent` is a function_call item with
    namespace multi_agent_v1 and name spawn_agent; the client's next turn, carrying that item and its output,
    is answered."""
    body = {**sent("codex_first_turn.json"), "max_output_tokens": FORCED_OUTPUT_TOKENS,
            "tool_choice": {"type": "function", "name": "multi_agent_v1.spawn_agent"}}
    response = finished(streamed(http, body))
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    assert call["namespace"] == "multi_agent_v1" and call["name"] == "spawn_agent"
    added = [e["item"] for e in streamed(http, body) if e["type"] == "response.output_item.added"]
    assert added[-1]["namespace"] == "multi_agent_v1" and added[-1]["name"] == "spawn_agent"
    follow_up = {**sent("codex_first_turn.json"), "max_output_tokens": OUTPUT_TOKENS}
    follow_up["input"] = [*follow_up["input"], {k: v for k, v in call.items() if k != "status"},
                          {"type": "function_call_output", "call_id": call["call_id"], "output": "agent started"}]
    assert finished(streamed(http, follow_up))["usage"]["input_tokens"] > response["usage"]["input_tokens"]


def anthropic_events(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    kinds, events = lines[0::2], [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert kinds == [f"event: {e['type']}" for e in events]
    return events


@pytest.mark.parametrize("name", ["claude_code_default_turn.json", "claude_code_bash_read_turn.json"])
def test_claude_codes_turns_are_answered_as_a_complete_stream(http, name):
    """Its output_config effort "high", its context_management (clear_thinking, keep all) and a system message
    among the messages were 400s before."""
    body = {**sent(name), "max_tokens": OUTPUT_TOKENS}
    assert body["output_config"] == {"effort": "high"} and body["context_management"]["edits"]
    events = anthropic_events(http, body)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    assert starts == [e["index"] for e in events if e["type"] == "content_block_stop"] == list(range(len(starts)))
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == OUTPUT_TOKENS
