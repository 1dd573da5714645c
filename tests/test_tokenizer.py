"""Tokenizers and chat templates: message starts come from one render and equal the per-prefix
definition they replace; the byte tokenizer's fast encoder equals the per-character one."""

from __future__ import annotations

import json
import random

import pytest

from cairn.errors import PromptTooLong
from cairn.request.prompt import tokenize_prompt
from cairn.request.tokenizer import (
    MAX_PREFIX_RENDERS,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    _token_at_or_after,
    common_prefix_len,
)

# The shape of Qwen3's template: a system/tools header, a backwards scan for the last user query
# (messages[::-1]), reasoning kept only after it, grouped tool responses, a `loop` variable.
QWEN_LIKE = """
{%- if tools %}<|im_start|>system
{{ messages[0].content + '\\n\\n' if messages[0].role == 'system' else '' }}# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content and loop.index0 > ns.last_query_index %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ message.content }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


def starts_by_prefix_renders(tok: Tokenizer, messages: list[dict], **extra) -> list[int]:
    """The definition encode_chat had before it became linear: where the render of messages[:k]
    stops agreeing with the whole render, for k = 1 .. len(messages)."""
    full = tok.render_chat(messages, add_generation_prompt=True, **extra)
    ids, offsets = tok.encode_with_offsets(full)
    return [_token_at_or_after(offsets, common_prefix_len(tok.render_chat(messages[:k], add_generation_prompt=False,
                                                                            **extra), full), len(ids))
            for k in range(1, len(messages) + 1)]


def conversation(rng: random.Random, n: int, roles=("user", "assistant", "tool")) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}] if rng.random() < 0.5 else []
    for i in range(n):
        role = "user" if i == 0 else rng.choice(roles)
        msg = {"role": role, "content": "".join(rng.choice("ab é\n<>{}") for _ in range(rng.randint(0, 12)))}
        if role == "assistant" and rng.random() < 0.5:
            msg["reasoning_content"] = "hmm"
        msgs.append(msg)
    return msgs


class QwenLike(ByteTokenizer):
    def __init__(self):
        super().__init__()
        Tokenizer.__init__(self, QWEN_LIKE, eos_token="<|im_end|>")


@pytest.mark.parametrize("seed", range(20))
def test_one_render_message_starts_equal_the_per_prefix_definition_chatml(seed):
    tok = ByteTokenizer()
    msgs = conversation(random.Random(seed), random.randint(1, 12))
    ids, starts = tok.encode_chat(msgs)
    assert ids == tok.encode(tok.render_chat(msgs))
    assert starts == starts_by_prefix_renders(tok, msgs)


@pytest.mark.parametrize("seed", range(20))
def test_one_render_message_starts_equal_the_per_prefix_definition_qwen_like(seed):
    """Without reasoning after the last query and without a trailing tool message (the two things
    this template renders differently when a message is last), both definitions agree exactly."""
    tok = QwenLike()
    rng = random.Random(seed)
    msgs = conversation(rng, rng.randint(1, 12), roles=("user", "assistant"))
    for m in msgs:
        m.pop("reasoning_content", None)
    tools = [{"name": "f", "parameters": {}}] if seed % 2 else None
    ids, starts = tok.encode_chat(msgs, tools=tools)
    assert ids == tok.encode(tok.render_chat(msgs, tools=tools))
    assert starts == starts_by_prefix_renders(tok, msgs, tools=tools)


def test_message_start_is_where_the_whole_render_starts_that_message_when_the_template_looks_ahead():
    """A tool message renders its closing tag only when it is last, so the render of messages[:k]
    differs from the whole one; the start is where message k begins in the whole render, the
    position a request that extends the conversation shares (the per-prefix definition cut the
    common first character '<' off message k)."""
    tok = QwenLike()
    msgs = [{"role": "user", "content": "q"}, {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    ids, starts = tok.encode_chat(msgs)
    text = tok.decode(ids)
    assert tok.decode(ids[:starts[1]]) == text[:text.index("<tool_response>\nr2")]
    assert tok.decode(ids[starts_by_prefix_renders(tok, msgs)[1]:]).startswith("tool_response>\nr2")
    longer = tok.encode_chat([*msgs, {"role": "user", "content": "next"}])[0]
    assert longer[:starts[2]] == ids[:starts[2]]  # the generation prompt start is shared too


def test_message_starts_take_one_render_whatever_the_number_of_messages(monkeypatch):
    tok = ByteTokenizer()
    renders = []
    original = tok._template.render
    monkeypatch.setattr(tok._template, "render", lambda *a, **kw: renders.append(1) or original(*a, **kw))
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(400)]
    ids, starts = tok.encode_chat(msgs)
    assert len(renders) == 1
    assert starts == starts_by_prefix_renders(tok, msgs)


def test_template_without_a_messages_loop_falls_back_to_prefix_renders():
    tok = ByteTokenizer()
    Tokenizer.__init__(tok, "{{ messages[0].content }}|{{ messages[-1].content }}")
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert tok.encode_chat(msgs)[1] == starts_by_prefix_renders(tok, msgs)


def test_a_template_without_a_messages_loop_renders_a_bounded_number_of_prefixes(monkeypatch):
    """The prefix renders find the starts of the last MAX_PREFIX_RENDERS messages alone (the earlier ones: 0,
    no start): one render per message made a request's cost quadratic in its number of messages (8,000
    empty ones, a 256 KiB body, took minutes of the server's CPU)."""
    tok = ByteTokenizer()
    Tokenizer.__init__(tok, "{% set turns = messages %}{% for m in turns %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    renders = []
    original = tok._template.render
    monkeypatch.setattr(tok._template, "render", lambda *a, **kw: renders.append(1) or original(*a, **kw))
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * (i % 3)} for i in range(400)]
    ids, starts = tok.encode_chat(msgs)
    assert len(renders) == 1 + 1 + MAX_PREFIX_RENDERS  # the instrumented one (no loop found), the whole, prefixes
    renders.clear()
    expected = starts_by_prefix_renders(tok, msgs)
    assert starts == [0] * (len(msgs) - MAX_PREFIX_RENDERS) + expected[-MAX_PREFIX_RENDERS:]
    short = msgs[:MAX_PREFIX_RENDERS]
    assert tok.encode_chat(short)[1] == starts_by_prefix_renders(tok, short)  # a short chat: every start, as before


def test_message_content_cannot_forge_a_start_marker():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "\x00" * 40}, {"role": "user", "content": "{{ cairn_message_mark }}"}]
    ids, starts = tok.encode_chat(msgs)
    assert starts == starts_by_prefix_renders(tok, msgs)
    assert tok.decode(ids) == tok.render_chat(msgs)


def reference_byte_encode(tok: ByteTokenizer, text: str) -> tuple[list[int], list[int]]:
    ids, offsets, i = [], [], 0
    while i < len(text):
        special = next((s for s in tok.SPECIALS if text.startswith(s, i)), None)
        if special:
            ids.append(tok.special_tokens[special])
            offsets.append(i)
            i += len(special)
            continue
        for b in text[i].encode("utf-8"):
            ids.append(b)
            offsets.append(i)
        i += 1
    return ids, offsets


@pytest.mark.parametrize("seed", range(10))
def test_byte_tokenizer_fast_encoder_equals_the_per_character_one(seed, monkeypatch):
    monkeypatch.setattr("cairn.request.tokenizer.ENCODE_CHUNK_CHARS", 7)  # chunk boundaries inside the text
    rng = random.Random(seed)
    pieces = ["a", "é", "€", "😀", "\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "|>"]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
    tok = ByteTokenizer()
    assert tok.encode_with_offsets(text) == reference_byte_encode(tok, text)
    assert tok.decode(tok.encode(text)) == text


def test_text_too_long_for_any_context_is_refused_before_encoding(monkeypatch):
    tok = ByteTokenizer()
    monkeypatch.setattr(tok, "encode_with_offsets", lambda text: pytest.fail("encoded a text that cannot fit"))
    too_long = "a" * (100 * tok.max_chars_per_token + 1)
    for kwargs in ({"prompt": too_long}, {"messages": [{"role": "user", "content": too_long}]}):
        with pytest.raises(PromptTooLong, match="context is 100 tokens"):
            tokenize_prompt(tok, max_model_len=100, **kwargs)


def test_a_prompt_that_may_fit_is_encoded_and_checked_by_the_engine():
    tok = ByteTokenizer()
    text = "<|im_end|>" * 100  # 1000 characters, within 77 tokens * 13: encoded (100 tokens)
    assert len(tokenize_prompt(tok, text, max_model_len=77).token_ids) == 100


def test_checkpoint_tokenizer_chars_per_token_bound_holds(tmp_path):
    from cairn.request.tokenizer import HFTokenizer
    from tests.checkpoints import write_tokenizer

    write_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    rng = random.Random(0)
    for _ in range(20):
        text = "".join(rng.choice(["a", "é", "😀", " ", "<|im_start|>", "<|im_end|>"]) for _ in range(50))
        assert len(text) <= len(tok.encode(text)) * tok.max_chars_per_token


LOOP = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("wrapper", ["{% if messages %}LOOP{% endif %}",
                                     "{% if not messages %}{% elif messages %}LOOP{% endif %}",
                                     "{% if not messages %}{% else %}LOOP{% endif %}",
                                     "{% with greeting = 'hi' %}LOOP{% endwith %}",
                                     "{% autoescape false %}LOOP{% endautoescape %}",
                                     "{% for turn in [1] %}LOOP{% endfor %}",
                                     "{% for turn in [] %}{% else %}LOOP{% endfor %}"])
def test_messages_loop_nested_in_a_block_is_found_and_gives_the_starts_in_one_render(wrapper, monkeypatch):
    """A checkpoint's template may wrap its loop over the messages in an if, with, autoescape or for block:
    the marker still finds the loop (one render), and the starts equal the per-prefix definition."""
    tok = ByteTokenizer()
    Tokenizer.__init__(tok, wrapper.replace("LOOP", LOOP) + "{% if add_generation_prompt %}<|im_start|>assistant\n"
                                                            "{% endif %}", eos_token="<|im_end|>")
    msgs = conversation(random.Random(3), 5)
    renders = []
    original = tok._template.render
    monkeypatch.setattr(tok._template, "render", lambda *a, **kw: renders.append(1) or original(*a, **kw))
    ids, starts = tok.encode_chat(msgs)
    assert len(renders) == 1
    assert starts == starts_by_prefix_renders(tok, msgs)


def write_merged_tokenizer(path, template: str, normalizer=None) -> None:
    """A checkpoint tokenizer whose one merge ("a" + "b" -> "ab") can span two messages' texts."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import models

    tok = FastTokenizer(models.BPE(vocab={"a": 0, "b": 1, "x": 2, "ab": 3}, merges=[("a", "b")]))
    tok.normalizer = normalizer
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))


def test_message_starting_inside_a_token_starts_at_that_token(tmp_path):
    """A template that joins messages without a separator lets one token span the end of a message and the
    start of the next ("a" + "b" -> "ab"): the next message starts at that token (the tokens before it
    hold only the earlier message), as a request extending the conversation shares the whole token."""
    write_merged_tokenizer(tmp_path, "{% for message in messages %}{{ message.content }}{% endfor %}")
    tok = HFTokenizer(tmp_path)
    msgs = [{"role": "user", "content": "xa"}, {"role": "user", "content": "bx"}]
    assert tok.encode_with_offsets("xabx") == ([2, 3, 2], [0, 1, 3])
    assert tok.encode_chat(msgs) == ([2, 3, 2], [1, 3])  # message 2 starts in "ab"; the generation prompt at the end


def test_text_a_normalizer_may_shrink_is_encoded_not_refused_by_its_length(tmp_path):
    """A normalizer other than Unicode's may delete text, so no character bound holds for the tokenizer: a
    text far longer than the context in characters is encoded, and fits when its tokens do."""
    from tokenizers import normalizers

    write_merged_tokenizer(tmp_path, "", normalizers.Replace("x", ""))
    tok = HFTokenizer(tmp_path)
    assert tok.max_chars_per_token is None
    assert tokenize_prompt(tok, "x" * 5000 + "ab", max_model_len=10).token_ids == [3]


def test_token_bytes_are_each_tokens_own_bytes_when_a_character_spans_tokens(tmp_path):
    """"é€" is five byte tokens, none a whole character (decode gives each as U+FFFD): token_bytes gives the
    byte each stands for, in the demo tokenizer, a byte-level BPE one and a byte-fallback one; a special
    token gives its text."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from cairn.request.tokenizer import BYTE_OF_CHAR
    from tests.checkpoints import write_tokenizer

    assert set(BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(BYTE_OF_CHAR.values()) == \
        list(range(256))
    (tmp_path / "level").mkdir()
    write_tokenizer(tmp_path / "level")
    fallback = FastTokenizer(models.BPE(vocab={"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "é": 257},
                                        merges=[], byte_fallback=True, unk_token="<unk>"))
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    (tmp_path / "fallback").mkdir()
    fallback.save(str(tmp_path / "fallback" / "tokenizer.json"))
    for tok in (ByteTokenizer(), HFTokenizer(tmp_path / "level")):
        ids = tok.encode("é€<|im_end|>")
        assert [tok.token_bytes(t) for t in ids] == [b"\xc3", b"\xa9", b"\xe2", b"\x82", b"\xac", b"<|im_end|>"]
    tok = HFTokenizer(tmp_path / "fallback")
    assert [tok.token_bytes(t) for t in tok.encode("€é")] == [b"\xe2", b"\x82", b"\xac", "é".encode()]
