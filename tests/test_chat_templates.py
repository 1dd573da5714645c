"""Chat templates with tools render token-identically to transformers' apply_chat_template.

The fixtures under tests/fixtures/templates are the real templates of the supported families:
`qwen3_5_xml_tools.jinja` is the Qwen3.5-architecture template (XML-style `<function=...>` calls,
`<think>` opened in the generation prompt), `qwen3_json_tools.jinja` the Qwen3 template whose JSON
`<tool_call>` format Qwen3-Next uses. Each test writes a tiny byte-level tokenizer (with Qwen's
`<think>`, `<tool_call>`, `<tool_response>` added tokens) and the template into a checkpoint directory,
then compares cairn's HFTokenizer with transformers' AutoTokenizer on the same messages, passed the
way the server passes them (through the request model: string arguments parsed into dicts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cairn.request.tokenizer import ByteTokenizer, HFTokenizer
from cairn.server.openai.protocol import ChatCompletionRequest

FIXTURES = Path(__file__).parent / "fixtures" / "templates"
TEMPLATES = ("qwen3_5_xml_tools.jinja", "qwen3_json_tools.jinja")
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]


def call(call_id: str, name: str, args: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "Weather in Paris?"}],
    "system_and_tool_result": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_weather", {"city": "Paris", "days": 2})]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
    ],
    "multi_turn_parallel_calls_with_reasoning": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Compare Paris and Rome."},
        {"role": "assistant", "content": "Let me check both.", "reasoning_content": "Two cities: two calls.",
         "tool_calls": [call("a", "get_weather", {"city": "Paris"}), call("b", "get_weather", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": "Paris is sunny, Rome rainy.", "reasoning_content": "Summarise."},
        {"role": "user", "content": "Search news about it."},
        {"role": "assistant", "content": "", "tool_calls": [call("c", "search", {"q": "weather news"})]},
        {"role": "tool", "tool_call_id": "c", "content": "nothing new"},
    ],
}


def write_checkpoint_tokenizer(path: Path, template: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(params=TEMPLATES)
def tokenizers(request, tmp_path):
    from transformers import AutoTokenizer

    write_checkpoint_tokenizer(tmp_path, (FIXTURES / request.param).read_text())
    return HFTokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))


def server_view(messages: list[dict], tools: list[dict] | None, **kwargs) -> tuple[list[dict], dict]:
    """The messages and template kwargs as the server passes them to the template."""
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools,
                                                 "chat_template_kwargs": kwargs or None})
    return body.template_messages(), body.template_kwargs()


def hf_ids(hf, messages: list[dict], **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_tools_render_token_identical_to_transformers(tokenizers, name):
    cairn_tok, hf = tokenizers
    messages, kwargs = server_view(CONVERSATIONS[name], TOOLS)
    ids, _ = cairn_tok.encode_chat(messages, **kwargs)
    assert ids == hf_ids(hf, messages, tools=kwargs["tools"])
    assert "get_weather" in cairn_tok.decode(ids)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_chat_template_kwargs_render_token_identical_to_transformers(tokenizers, enable_thinking):
    cairn_tok, hf = tokenizers
    messages, kwargs = server_view(CONVERSATIONS["one_turn"], None, enable_thinking=enable_thinking)
    ids, _ = cairn_tok.encode_chat(messages, **kwargs)
    assert ids == hf_ids(hf, messages, enable_thinking=enable_thinking)


def test_tools_change_the_prompt(tokenizers):
    cairn_tok, _ = tokenizers
    messages, kwargs = server_view(CONVERSATIONS["one_turn"], TOOLS)
    with_tools, _ = cairn_tok.encode_chat(messages, **kwargs)
    without, _ = cairn_tok.encode_chat(messages)
    assert len(with_tools) > len(without) + 50


AGENTIC_LOOP = [  # one user query, then the agent's calls and their results: no history rewriting
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Compare Paris and Rome."},
    {"role": "assistant", "content": "Let me check both.", "reasoning_content": "Two cities: two calls.",
     "tool_calls": [call("a", "get_weather", {"city": "Paris"}), call("b", "get_weather", {"city": "Rome"})]},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
    {"role": "assistant", "content": "", "reasoning_content": "Now search.",
     "tool_calls": [call("c", "search", {"q": "weather news"})]},
    {"role": "tool", "tool_call_id": "c", "content": "nothing new"},
]


def test_message_starts_land_on_message_boundaries_with_reasoning_and_tool_calls(tokenizers):
    """In an agentic loop, every message start (past the first user message) is a `<|im_start|>`, or,
    for consecutive tool results that the template merges into one user turn, the next tool response."""
    cairn_tok, _ = tokenizers
    messages, kwargs = server_view(AGENTIC_LOOP, TOOLS)
    ids, starts = cairn_tok.encode_chat(messages, **kwargs)
    assert starts == sorted(starts) and starts[-1] < len(ids)
    im_start = cairn_tok.special_tokens["<|im_start|>"]
    for k, pos in enumerate(starts, start=1):  # starts[k - 1]: where messages[k] (or the answer) starts
        if k < len(messages) and messages[k]["role"] == "tool" and messages[k - 1]["role"] == "tool":
            assert cairn_tok.decode(ids[pos:pos + 2]) == "\n<tool_response>", k
        elif k > 1:
            assert ids[pos] == im_start, (k, cairn_tok.decode(ids[pos - 5:pos + 5]))


def test_message_starts_after_a_rewritten_turn_are_shared_by_the_next_turn(tokenizers):
    """After a new user query the templates drop earlier reasoning, so the render of a prefix of the
    conversation differs from the whole one inside that turn. Message starts are positions in the whole
    render, which the next turn's prompt (this conversation + an answer + a new query) renders the same
    way, so a snapshot taken at such a message start is a resume point for the next turn."""
    cairn_tok, _ = tokenizers
    messages, kwargs = server_view(CONVERSATIONS["multi_turn_parallel_calls_with_reasoning"], TOOLS)
    ids, starts = cairn_tok.encode_chat(messages, **kwargs)
    full = cairn_tok.render_chat(messages, **kwargs)
    assert "Two cities" not in full  # the earlier turn's reasoning is dropped from the whole render
    later = messages + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks!"}]
    later_ids, later_starts = cairn_tok.encode_chat(later, **kwargs)
    # Up to the last user query: after it the template renders turns differently once a newer query
    # exists (their reasoning blocks go), which no placement can share; prompt-end snapshots cover that.
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    shared = starts[:last_query]  # starts[k - 1]: where messages[k] starts, k = 1 .. last_query
    assert "Paris is sunny" in cairn_tok.decode(ids[:shared[-1]])  # past the rewritten turn
    for pos in shared:
        assert later_ids[:pos] == ids[:pos]
    assert later_starts[:last_query] == shared


def test_demo_template_renders_plain_chats_as_chatml_and_tools_in_qwen35_style():
    tok = ByteTokenizer()
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
             {"role": "assistant", "content": "A"}]
    assert tok.render_chat(plain) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                                      "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>assistant\n")
    messages, kwargs = server_view(CONVERSATIONS["system_and_tool_result"], TOOLS)
    text = tok.render_chat(messages, **kwargs)
    assert '"name": "get_weather"' in text and "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert tok.render_chat(plain, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
