"""Special tokens in generated text and `skip_special_tokens` (vLLM's field, default true): the text of the
tokenizer's special added tokens is left out of the output, streamed and whole, while token ids and the
logprobs' token strings keep them; stop strings are matched against the text returned; the chat parsers
still see their markers where a tokenizer has them as special tokens. The model's tokens are scripted
(`scripted`: the engine appends the given tokens in place of the sampled ones), so the special tokens come
exactly where a test puts them.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.engine.llm import LLM
from cairn.engine.outputs import Detokenizer
from cairn.request.sampling_params import SamplingParams
from cairn.request.tokenizer import ByteTokenizer, HFTokenizer
from cairn.server.app import create_app
from cairn.server.chat.output import ChatPlan
from cairn.server.options import ServerOptions
from tests.checkpoints import write_checkpoint
from tests.test_chat_templates import FIXTURES, TOOLS

BYTE = ByteTokenizer()
IM_START, IM_END = BYTE.special_tokens["<|im_start|>"], BYTE.special_tokens["<|im_end|>"]
SCRIPT = [*b"Hi", IM_START, *b" there", IM_START, *b"!", IM_END]  # the demo's tokens: <|im_end|> ends the answer
SHOWN = "Hi<|im_start|> there<|im_start|>!"  # what skip_special_tokens false returns (today's text)
SKIPPED = "Hi there!"


def scripted(monkeypatch, engine: Engine, tokens: list[int]) -> None:
    """Every request's i-th generated token is tokens[i] (the sampled one past the script's end)."""
    real = engine._append

    def append(seq, s):
        i = seq.num_output_tokens
        if s.error is None and i < len(tokens):
            s = dataclasses.replace(s, token=tokens[i])
        return real(seq, s)

    monkeypatch.setattr(engine, "_append", append)


# ---- the detokenizer -----------------------------------------------------------------------------

def test_detokenizer_leaves_hidden_tokens_text_out_and_matches_stop_strings_in_the_text_left():
    ids = [*b"ab", IM_START, *b"cd"]
    hidden = Detokenizer(BYTE, (), hidden=frozenset({IM_START}))
    deltas = [hidden.add(t, final=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
    assert "".join(deltas) == hidden.text == "abcd"
    stopped = Detokenizer(BYTE, ("bc",), hidden=frozenset({IM_START}))
    results = [stopped.add(t, final=False) for t in ids[:4]]
    assert results[-1][1] and stopped.text == "a"  # "bc" spans the hidden token: the text the user gets holds it
    shown = Detokenizer(BYTE, ("bc",))
    assert not any(shown.add(t, final=False)[1] for t in ids)


# ---- the engine (offline API) --------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm() -> LLM:
    with LLM(kv_cache_gib=0.01, state_cache_gib=0.01, max_model_len=256, max_num_seqs=4) as llm:
        yield llm


def test_special_tokens_text_is_left_out_by_default_and_kept_with_skip_special_tokens_false(llm, monkeypatch):
    scripted(monkeypatch, llm.engine, SCRIPT)
    (skipped,) = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0))
    (shown,) = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0, skip_special_tokens=False))
    assert skipped.text == SKIPPED and shown.text == SHOWN
    assert skipped.token_ids == shown.token_ids == SCRIPT and skipped.finish_reason == shown.finish_reason == "stop"


def test_every_choice_of_n_leaves_special_tokens_text_out(llm, monkeypatch):
    scripted(monkeypatch, llm.engine, SCRIPT)
    outs = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0, n=3))
    assert [o.text for o in outs] == [SKIPPED] * 3 and all(o.token_ids == SCRIPT for o in outs)


def test_stop_strings_are_matched_against_the_text_the_user_gets(llm, monkeypatch):
    """vLLM looks for stop strings in the output text, which skip_special_tokens has already left the
    special tokens' text out of: "i t" spans a special token and stops the answer; with
    skip_special_tokens false the text holds `<|im_start|>` there, and it does not."""
    scripted(monkeypatch, llm.engine, SCRIPT)
    for include, text in ((False, "H"), (True, "Hi t")):
        (out,) = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0, stop=("i t",),
                                                      include_stop_str_in_output=include))
        assert out.text == text and out.finish_reason == "stop"
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0, stop=("i t",),
                                                  skip_special_tokens=False))
    assert out.text == SHOWN
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0, stop=("<|im_start|>",)))
    assert out.text == SKIPPED  # a special token's text is not in the text: stop on it with stop_token_ids


def test_a_hidden_special_token_still_counts_towards_min_tokens_and_max_tokens(llm, monkeypatch):
    scripted(monkeypatch, llm.engine, SCRIPT)
    (early,) = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0, stop=("i t",), min_tokens=3))
    assert early.text == "H"  # the stop string completes at the 4th token, past min_tokens = 3
    (cut,) = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0))
    assert cut.token_ids == SCRIPT[:3] and cut.text == "Hi" and cut.finish_reason == "length"


# ---- the server (demo model) ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_engine() -> Engine:
    return Engine(config_with_overrides(EngineConfig(), kv_cache_gib=0.01, state_cache_gib=0.01, max_model_len=256,
                                        max_num_seqs=4))


@pytest.fixture
def demo(demo_engine, monkeypatch):
    scripted(monkeypatch, demo_engine, SCRIPT)
    with TestClient(create_app(demo_engine, ServerOptions())) as client:
        yield client


def events(response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


COMPLETION = {"model": "cairn-demo-random", "prompt": "Hello", "max_tokens": 32, "temperature": 0}
CHAT = {"model": "cairn-demo-random", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32,
        "temperature": 0}


@pytest.mark.parametrize("skip", [None, True, False])
def test_completions_skip_special_tokens_whole_and_streamed(demo, skip):
    field = {} if skip is None else {"skip_special_tokens": skip}
    expected = SHOWN if skip is False else SKIPPED
    r = demo.post("/v1/completions", json={**COMPLETION, **field, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == expected and choice["token_ids"] == SCRIPT
    r = demo.post("/v1/completions", json={**COMPLETION, **field, "stream": True, "n": 2})
    texts = ["", ""]
    for chunk in events(r):
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [expected] * 2


@pytest.mark.parametrize("skip", [None, False])
def test_chat_content_skips_special_tokens_whole_and_streamed(demo, skip):
    field = {} if skip is None else {"skip_special_tokens": skip}
    expected = SHOWN if skip is False else SKIPPED
    r = demo.post("/v1/chat/completions", json={**CHAT, **field})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected
    r = demo.post("/v1/chat/completions", json={**CHAT, **field, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in events(r) if c["choices"]) == expected


def test_anthropic_messages_leave_special_tokens_text_out(demo):
    r = demo.post("/v1/messages", json={"model": "cairn-demo-random", "max_tokens": 32, "temperature": 0,
                                        "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": SKIPPED}]


def test_logprobs_show_a_special_tokens_text_and_offsets_point_into_the_text_returned(demo):
    """As vLLM: a logprobs entry names its token's text whatever skip_special_tokens; text_offset is where
    each token starts in the text returned (a token whose text is left out takes no room in it)."""
    r = demo.post("/v1/completions", json={**COMPLETION, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][:4] == ["H", "i", "<|im_start|>", " "]
    assert lp["text_offset"][:4] == [0, 1, 2, 2]
    assert r.json()["choices"][0]["text"][lp["text_offset"][3]:] == " there!"
    r = demo.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
    assert [e["token"] for e in r.json()["choices"][0]["logprobs"]["content"][:3]] == ["H", "i", "<|im_start|>"]
    r = demo.post("/v1/completions", json={**COMPLETION, "logprobs": 0, "skip_special_tokens": False})
    assert r.json()["choices"][0]["logprobs"]["text_offset"][:4] == [0, 1, 2, 2 + len("<|im_start|>")]


def test_skip_special_tokens_must_be_a_bool_and_spaces_between_special_tokens_is_refused_by_name(demo):
    r = demo.post("/v1/completions", json={**COMPLETION, "skip_special_tokens": "yes"})
    assert r.status_code == 400
    r = demo.post("/v1/chat/completions", json={**CHAT, "spaces_between_special_tokens": False})
    assert r.status_code == 400 and "spaces_between_special_tokens" in r.text


# ---- chat parsers over a tokenizer whose markers are special tokens ------------------------------

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def test_chat_plan_keeps_the_markers_of_the_parsers_it_runs():
    assert ChatPlan("qwen3", True, {"f": {}}).markers == tuple(MARKERS)
    assert ChatPlan("qwen3", False, None).markers == ("<think>", "</think>")
    assert ChatPlan("none", False, {"f": {}}).markers == ("<tool_call>", "</tool_call>")
    assert ChatPlan("none", False, None).markers == ()


@pytest.fixture(scope="module")
def marker_checkpoint(tmp_path_factory) -> tuple[Engine, HFTokenizer]:
    """A tiny Qwen3.5 checkpoint whose tokenizer has the reasoning and tool-call markers as special tokens
    (some families' tokenizers mark such tags special), with Qwen3.5's template (it opens `<think>`)."""
    path = tmp_path_factory.mktemp("markers")
    write_checkpoint("qwen3_5_text", path)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *MARKERS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": (FIXTURES / "qwen3_5_xml_tools.jinja").read_text(), "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    engine = Engine(config_with_overrides(EngineConfig(), model=str(path), kv_cache_gib=0.01, state_cache_gib=0.01,
                                          max_model_len=2048, max_num_seqs=2), show_progress=False)
    assert set(MARKERS) <= set(engine.tokenizer.special_tokens)
    return engine, engine.tokenizer


ANSWER = ("Let me see.</think>\n\nSure<|im_start|>!\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
          "</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_reasoning_and_tool_calls_parse_when_their_markers_are_special_tokens(marker_checkpoint, monkeypatch,
                                                                              skip, stream):
    engine, tok = marker_checkpoint
    script = [*tok.encode(ANSWER), tok.special_tokens["<|im_end|>"]]
    assert tok.special_tokens["</think>"] in script and tok.special_tokens["<tool_call>"] in script
    scripted(monkeypatch, engine, script)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS[:1],
            "max_tokens": 200, "temperature": 0, "skip_special_tokens": skip, "stream": stream}
    with TestClient(create_app(engine, ServerOptions(served_model_name="tiny"))) as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [c["choices"][0] for c in events(r) if c["choices"]]
        reasoning = "".join(c["delta"].get("reasoning_content") or "" for c in chunks)
        content = "".join(c["delta"].get("content") or "" for c in chunks)
        calls = [t["function"] for c in chunks for t in c["delta"].get("tool_calls") or [] if "name" in t["function"]]
        finish = chunks[-1]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        message = choice["message"]
        reasoning, content, finish = message["reasoning_content"], message["content"], choice["finish_reason"]
        calls = [t["function"] for t in message["tool_calls"]]
    assert reasoning == "Let me see."
    assert content == ("Sure!\n" if skip else "Sure<|im_start|>!\n")
    assert [c["name"] for c in calls] == ["get_weather"] and finish == "tool_calls"
