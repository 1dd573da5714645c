"""Streamed twins of the agentic cases whose served tests were whole-answer only (issue 10 point 7:
every case streamed and not), against a real `cairn serve` through the official `openai` and
`anthropic` clients: a stream gives what the whole answer gives, field for field.

    return_token_ids            token_ids per chunk, prompt_token_ids on the last chunk (chat: beside the
                                choices, as vLLM's chunks carry it; completions: in the choice)
    tool history, tool_choice none   the prompt the stream's usage counts is /tokenize's; no calls
    min_tokens, include_stop_str_in_output, response_format json_object
    /v1/messages                system, tool_use / tool_result history, stop_sequences, cache usage
    --reasoning-parser none / --tool-call-parser none (a second server): content only, streamed too
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.server_process import served_fixture

MODEL = "cairn-demo-random"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = ASK + [
    {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
GREEDY = dict(model=MODEL, temperature=0, max_tokens=12)


served = served_fixture("--max-model-len", "2048", "--max-num-seqs", "4", "--log-level", "WARNING")


def streamed(client: openai.OpenAI, **ask) -> tuple[str, str, list]:
    """(content, finish_reason, chunks) of a streamed chat."""
    chunks = list(client.chat.completions.create(stream=True, **ask))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    return content, finish, chunks


def test_streamed_chat_returns_the_token_ids_of_the_whole_answer(client, http):
    extra = {"return_token_ids": True}
    whole = client.chat.completions.create(messages=ASK, extra_body=extra, **GREEDY)
    _, _, chunks = streamed(client, messages=ASK, extra_body=extra, **GREEDY)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert ids == whole.choices[0].model_extra["token_ids"] and len(ids) == whole.usage.completion_tokens
    prompts = [c.model_extra["prompt_token_ids"] for c in chunks if c.model_extra.get("prompt_token_ids")]
    assert prompts == [http.post("/tokenize", json={"messages": ASK}).json()["tokens"]]
    assert chunks[-1].model_extra.get("prompt_token_ids")  # beside the choices, on the last chunk


def test_streamed_completion_returns_the_token_ids_in_the_choice(client):
    ask = dict(model=MODEL, prompt="token ids", max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    whole = client.completions.create(**ask).choices[0].model_extra
    chunks = [c.choices[0].model_extra for c in client.completions.create(stream=True, **ask) if c.choices]
    assert [t for c in chunks for t in c.get("token_ids") or []] == whole["token_ids"]
    assert [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")] == [whole["prompt_token_ids"]]


def test_streamed_tool_history_renders_the_prompt_tokenize_gives(client, http):
    ask = dict(messages=HISTORY, tools=[WEATHER], **GREEDY)
    content, _, chunks = streamed(client, stream_options={"include_usage": True}, **ask)
    usage = next(c.usage for c in chunks if c.usage)
    count = http.post("/tokenize", json={"messages": HISTORY, "tools": [WEATHER]}).json()["count"]
    whole = client.chat.completions.create(**ask)
    assert usage.prompt_tokens == whole.usage.prompt_tokens == count
    assert content == (whole.choices[0].message.content or "")


def test_tool_choice_none_still_renders_the_tools_and_returns_no_calls(client):
    """As vLLM by default: the template still sees the tools; nothing is parsed into calls."""
    auto = client.chat.completions.create(messages=ASK, tools=[WEATHER], **GREEDY)
    whole = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none", **GREEDY)
    content, finish, chunks = streamed(client, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       stream_options={"include_usage": True}, **GREEDY)
    usage = next(c.usage for c in chunks if c.usage)
    assert whole.usage.prompt_tokens == auto.usage.prompt_tokens == usage.prompt_tokens
    assert not whole.choices[0].message.tool_calls and whole.choices[0].finish_reason != "tool_calls"
    assert (content, finish) == (whole.choices[0].message.content, whole.choices[0].finish_reason)
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_streamed_min_tokens_and_include_stop_str_in_output(client):
    eos = dict(model=MODEL, messages=ASK, max_tokens=10, temperature=0, logit_bias={"258": 100},
               extra_body={"min_tokens": 3}, stream_options={"include_usage": True})
    _, finish, chunks = streamed(client, **eos)
    assert finish == "stop" and next(c.usage for c in chunks if c.usage).completion_tokens == 4
    text = client.chat.completions.create(messages=ASK, extra_body={"ignore_eos": True}, **GREEDY).choices[0]
    stop = text.message.content[2:4]
    kept, finish, _ = streamed(client, messages=ASK, stop=[stop], **GREEDY,
                               extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    content = text.message.content
    assert finish == "stop" and kept == content[: content.index(stop) + len(stop)]


def test_streamed_json_object_is_the_whole_answer(client):
    ask = dict(model=MODEL, messages=ASK, max_tokens=64, temperature=1.0, seed=4,
               response_format={"type": "json_object"})
    whole = client.chat.completions.create(**ask).choices[0]
    content, finish, _ = streamed(client, **ask)
    assert (content, finish) == (whole.message.content, whole.finish_reason)
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # a random model may write a long key; the text is still the start of an object
        assert content.startswith("{")


# ---- /v1/messages -----------------------------------------------------------------------------------

CLAUDE_TOOL = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
CLAUDE_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool", "signature": ""},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
SYSTEM = "You are a weather agent. " * 40


def test_anthropic_streamed_history_with_system_matches_the_whole_answer(claude):
    ask = dict(model=MODEL, max_tokens=12, system=SYSTEM, messages=CLAUDE_HISTORY, tools=[CLAUDE_TOOL],
               thinking={"type": "disabled"}, extra_body={"temperature": 0})
    whole = claude.messages.create(**ask)
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # the same system and history again: resumed from the cache
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_anthropic_streamed_stop_sequence(claude):
    plain = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}],
                 thinking={"type": "disabled"}, extra_body={"temperature": 0})
    text = claude.messages.create(**plain).content[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the demo model printed nothing usable as a stop sequence")
    with claude.messages.stream(**plain, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == text[:text.index(stop)]


# ---- --reasoning-parser none, --tool-call-parser none ----------------------------------------------------

served_raw = served_fixture("--max-model-len", "1024", "--max-num-seqs", "2", "--log-level", "WARNING",
                            "--reasoning-parser", "none", "--tool-call-parser", "none")


@pytest.fixture(scope="module")
def raw_client(served_raw):
    return served_raw.openai


def test_parsers_turned_off_leave_reasoning_and_calls_in_content_streamed_and_not(raw_client):
    ask = dict(messages=ASK, tools=[WEATHER], extra_body={"chat_template_kwargs": {"enable_thinking": True}},
               **GREEDY)
    whole = raw_client.chat.completions.create(**ask).choices[0]
    assert whole.message.content and not whole.message.tool_calls
    assert (whole.message.model_extra or {}).get("reasoning_content") is None
    content, finish, chunks = streamed(raw_client, **ask)
    assert (content, finish) == (whole.message.content, whole.finish_reason)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(getattr(d, "reasoning_content", None) or d.tool_calls for d in deltas)
    with pytest.raises(openai.BadRequestError) as info:
        raw_client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="required", **GREEDY)
    assert info.value.body["param"] == "tool_choice"
