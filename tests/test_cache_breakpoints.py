"""Anthropic `cache_control` marks are cache breakpoints: each puts a snapshot (source `breakpoint`) at the token
position where the marked block ends in the rendered prompt, and the usage says in Anthropic's terms what the
request read from the cache, stored at its breakpoints, and computed besides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from cairn.cache.policy.placement import PlacementInput, PlacementOptions, place, placed_breakpoints
from cairn.config import RANDOM_DEMO_NAME
from cairn.request.prompt import CACHE_MARKS, tokenize_prompt
from cairn.request.tokenizer import ByteTokenizer
from cairn.server.anthropic.request import MessagesRequest
from cairn.server.errors import from_validation_errors
from tests.server_process import served_fixture

FIXTURES = Path(__file__).parent / "fixtures" / "agent_requests"
EPHEMERAL = {"type": "ephemeral"}


def tokenized(body: dict):
    """The prompt of a Messages body as the server tokenizes it (the demo model's byte tokenizer)."""
    request = MessagesRequest.model_validate(body)
    chat = request.to_chat()
    kwargs = {**chat.prompt_kwargs(), CACHE_MARKS: request.cache_marks()}
    return tokenize_prompt(ByteTokenizer(), None, chat.template_messages(), kwargs)


def marked_texts(body: dict) -> list[str]:
    """The texts of the marked text blocks, in the order they are rendered (system first, then the messages)."""
    system = [b["text"] for b in body.get("system") or [] if b.get("cache_control")]
    turns = [b["text"] for m in body["messages"] if isinstance(m["content"], list)
             for b in m["content"] if b.get("type") == "text" and b.get("cache_control")]
    return system + turns


@pytest.mark.parametrize("name", ["claude_code_bash_read_turn.json", "claude_code_default_turn.json"])
def test_claude_codes_marks_are_located_where_each_marked_block_ends_in_the_render(name):
    """Claude Code marks two system blocks and the latest turn's last text block: the prompt decoded up to each
    breakpoint ends with that block's text, and what follows it there is what the template renders after the
    block (the next system block's separator, or the end of the message)."""
    body = json.loads((FIXTURES / name).read_text())
    prompt = tokenized(body)
    texts = marked_texts(body)
    assert len(prompt.breakpoints) == len(texts) == 3
    tok = ByteTokenizer()
    for bp, text in zip(prompt.breakpoints, texts, strict=True):
        assert tok.decode(prompt.token_ids[:bp.position]).endswith(text)
        after = tok.decode(prompt.token_ids[bp.position:bp.position + 10])
        assert after.startswith(("\n", "<|im_end|>")), after
        assert bp.ttl_s == 300  # no ttl given: 5 minutes
    system = body["system"]
    joined = "\n".join(b["text"] for b in system)
    assert tok.decode(prompt.token_ids[:prompt.breakpoints[1].position]).endswith(joined)  # the whole system prompt


def test_a_marked_tool_is_located_at_the_end_of_its_json_and_a_marked_tool_result_at_the_end_of_its_text():
    tools = [{"name": "a", "input_schema": {"type": "object"}},
             {"name": "b", "input_schema": {"type": "object"}, "cache_control": {**EPHEMERAL, "ttl": "1h"}}]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "a", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out put",
                                              "cache_control": EPHEMERAL}]}]
    prompt = tokenized({"model": "m", "max_tokens": 5, "tools": tools, "messages": messages})
    tok = ByteTokenizer()
    tool_json = json.dumps({"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}})
    (result, tool) = sorted(prompt.breakpoints, key=lambda b: -b.position)
    assert tok.decode(prompt.token_ids[:tool.position]).endswith(tool_json) and tool.ttl_s == 3600
    assert tok.decode(prompt.token_ids[:result.position]).endswith("out put") and result.ttl_s == 300


@pytest.mark.parametrize("marked", [0, 1])
def test_a_marked_tool_use_block_is_located_where_the_render_of_its_call_ends(marked):
    """Of two calls in one assistant turn, the marked one (the first or the last) ends its breakpoint: the render
    up to it ends with that call's closing tag, holds its arguments, and what follows is the next call's opening
    or the end of the turn."""
    uses = [{"type": "tool_use", "id": f"t{k}", "name": name, "input": {"path": f"/tmp/{name}.txt"}}
            for k, name in enumerate(["read", "grep"])]
    uses[marked]["cache_control"] = {**EPHEMERAL, "ttl": "1h"}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": uses},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u["id"], "content": "x"}
                                             for u in uses]}]
    prompt = tokenized({"model": "m", "max_tokens": 5, "messages": messages})
    (bp,) = prompt.breakpoints
    tok = ByteTokenizer()
    before, after = tok.decode(prompt.token_ids[:bp.position]), tok.decode(prompt.token_ids[bp.position:])
    name = uses[marked]["name"]
    assert before.endswith("</tool_call>") and f"/tmp/{name}.txt" in before[before.rindex("<tool_call>"):]
    assert after.startswith("\n<tool_call>" if marked == 0 else "<|im_end|>"), after[:20]
    assert bp.ttl_s == 3600


@pytest.mark.parametrize(("cache_control", "param"), [({**EPHEMERAL, "ttl": "10m"}, "cache_control.ttl"),
                                                      ({"type": "persistent"}, "cache_control.type")])
@pytest.mark.parametrize("where", ["system", "messages", "tools"])
def test_a_ttl_other_than_5m_or_1h_and_a_type_other_than_ephemeral_are_400s_naming_the_field(cache_control, param,
                                                                                             where):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    marked = {"type": "text", "text": "x", "cache_control": cache_control}
    field = {"system": ("system", [marked]),
             "messages": ("messages", [{"role": "user", "content": [marked]}]),
             "tools": ("tools", [{"name": "f", "input_schema": {}, "cache_control": cache_control}])}[where]
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate({**body, field[0]: field[1]})
    error = from_validation_errors(e.value.errors(include_url=False))
    assert error.status == 400 and error.param.endswith(param) and error.param.startswith(where), error.param


def test_placement_puts_a_snapshot_at_each_breakpoint_past_the_resume_point_the_prompt_end_keeping_its_name():
    inp = PlacementInput(prompt_len=100, resume_position=10, match_length=10, path_has_deeper_snapshot=False,
                         message_starts=(40,), breakpoints=(5, 37, 40, 100))
    opts = PlacementOptions(interval_tokens=0)
    chosen = place(inp, opts)
    assert chosen == {37: "breakpoint", 40: "breakpoint", 100: "prompt_end"}
    assert placed_breakpoints(chosen, inp, opts) == {37, 40, 100}
    aligned = PlacementOptions(interval_tokens=0, align=16)
    chosen = place(inp, aligned)
    assert chosen == {32: "breakpoint", 96: "prompt_end"}  # moved down to the prefill blocks, as every position is
    assert placed_breakpoints(chosen, inp, aligned) == {32, 96}  # the breakpoint at 100 went down with the end
    assert place(inp, PlacementOptions(interval_tokens=0, policy="prompt_end_branch")) == {100: "prompt_end"}


# ---- served: the official anthropic client against a real `cairn serve` -------------------------------------

served = served_fixture("--log-level", "WARNING")


def system_prefix_tokens(text: str) -> int:
    """Tokens of the demo template's render up to the end of a system prompt `text` (no tools)."""
    return len(ByteTokenizer().encode("<|im_start|>system\n" + text))


def ask(claude, system: list[dict], **kwargs):
    return claude.messages.create(model=RANDOM_DEMO_NAME, max_tokens=4, system=system,
                                  messages=[{"role": "user", "content": "hi"}], **kwargs)


def counted(claude, system: list[dict]) -> int:
    return claude.messages.count_tokens(model=RANDOM_DEMO_NAME, system=system,
                                        messages=[{"role": "user", "content": "hi"}]).input_tokens


def test_a_request_sharing_a_marked_system_prompt_resumes_at_its_breakpoint_and_usage_adds_up(claude):
    """The first request stores its marked system prompt (cache_creation_input_tokens: the tokens up to the
    breakpoint); the second shares that block, adds one right after it, and resumes exactly at the breakpoint,
    from the snapshot of source `breakpoint`, storing what lies up to its own (deeper) breakpoint."""
    a = {"type": "text", "text": "You are the first agent of this test. Be brief.", "cache_control": EPHEMERAL}
    b = {"type": "text", "text": "Answer in French.", "cache_control": {**EPHEMERAL, "ttl": "1h"}}
    first = ask(claude, [a])
    end_a = system_prefix_tokens(a["text"])
    u = first.usage
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (0, end_a)
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted(claude, [a])
    second = ask(claude, [a, b])
    u = second.usage
    assert u.model_extra["cairn"]["resume_position"] == end_a and u.model_extra["cairn"]["source"] == "breakpoint"
    end_b = system_prefix_tokens(a["text"] + "\n" + b["text"])
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (end_a, end_b - end_a)
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted(claude, [a, b])
    again = ask(claude, [a, b])  # the same prompt: resumed at its prompt end, nothing newly stored
    u = again.usage
    assert u.cache_creation_input_tokens == 0 and u.cache_read_input_tokens > end_b
    assert u.input_tokens + u.cache_read_input_tokens == counted(claude, [a, b])


def test_a_request_without_marks_stores_nothing_for_the_client(claude):
    u = ask(claude, [{"type": "text", "text": "An unmarked system prompt of its own."}]).usage
    assert u.cache_creation_input_tokens == 0 and u.model_extra["cairn"]["snapshots_taken"] > 0


def test_the_streamed_usage_counts_the_breakpoints_stored_in_message_start_and_message_delta(claude):
    a = {"type": "text", "text": "You are the streamed agent of this test.", "cache_control": EPHEMERAL}
    events = list(ask(claude, [a], stream=True))
    start = events[0].message.usage
    (delta,) = [e for e in events if e.type == "message_delta"]
    end_a = system_prefix_tokens(a["text"])
    total = counted(claude, [a])
    for usage in (start, delta.usage):
        # (the start of the render is shared with the other tests' prompts: a snapshot there may be resumed)
        assert usage.cache_creation_input_tokens > 0
        assert usage.cache_read_input_tokens + usage.cache_creation_input_tokens == end_a
        assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == total


def test_the_top_level_cache_control_marks_the_end_of_the_last_block():
    """Automatic caching: the request's own cache_control is a breakpoint where the last message's text ends."""
    body = {"model": "m", "max_tokens": 5, "cache_control": {**EPHEMERAL, "ttl": "1h"},
            "system": "be brief", "messages": [{"role": "user", "content": "first turn"},
                                               {"role": "assistant", "content": "ok"},
                                               {"role": "user", "content": [{"type": "text", "text": "last turn"}]}]}
    prompt = tokenized(body)
    [bp] = prompt.breakpoints
    assert ByteTokenizer().decode(prompt.token_ids[:bp.position]).endswith("last turn") and bp.ttl_s == 3600
    assert not tokenized({**body, "cache_control": None}).breakpoints


def test_a_marked_chat_content_part_is_a_breakpoint_at_the_end_of_its_text():
    """Clients that send Anthropic's cache_control on the chat route put it on text parts: each is located where
    its part's text ends in the render, with its TTL."""
    from cairn.server.chat.schema import part_cache_marks
    from cairn.server.openai.protocol import ChatCompletionRequest
    parts = [{"type": "text", "text": "stable instructions", "cache_control": {**EPHEMERAL, "ttl": "1h"}},
             {"type": "text", "text": "today is monday"}]
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": parts},
        {"role": "user", "content": [{"type": "text", "text": "a question", "cache_control": EPHEMERAL}]}]})
    kwargs = {**request.prompt_kwargs(), CACHE_MARKS: part_cache_marks(request.messages)}
    prompt = tokenize_prompt(ByteTokenizer(), None, request.template_messages(), kwargs)
    tok = ByteTokenizer()
    (system, question) = prompt.breakpoints
    assert tok.decode(prompt.token_ids[:system.position]).endswith("stable instructions") and system.ttl_s == 3600
    assert tok.decode(prompt.token_ids[:question.position]).endswith("a question") and question.ttl_s == 300


def test_a_chat_request_resumes_at_the_breakpoint_of_its_marked_content_part(http):
    """The chat route places the marked part's snapshot: a later request sharing the part, then differing right
    after it, resumes exactly where the part ends, from that snapshot."""
    stable = "You are the chat route's agent in this test. Be brief."

    def chat(tail: str) -> dict:
        parts = [{"type": "text", "text": stable, "cache_control": EPHEMERAL}, {"type": "text", "text": tail}]
        body = {"model": RANDOM_DEMO_NAME, "max_tokens": 2, "messages": [{"role": "system", "content": parts},
                                                                        {"role": "user", "content": "hi"}]}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["cairn"]

    chat("It is monday.")
    again = chat("It is tuesday.")
    assert again["resume_position"] == system_prefix_tokens(stable) and again["source"] == "breakpoint"
