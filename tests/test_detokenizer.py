"""Incremental detokenization: whole characters only, stop strings held back and cut, both decoders agree."""

from __future__ import annotations

import pytest

from cairn.engine.outputs import Detokenizer, WindowDecoder
from cairn.request.tokenizer import ByteTokenizer, HFTokenizer
from tests.checkpoints import write_tokenizer

TEXT = "naïve café 東京は日本の首都です 🙂🚀 done"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)  # byte-level: a CJK character is three tokens, an emoji four
    return HFTokenizer(path)


def stream(detok: Detokenizer, ids: list[int]) -> tuple[list[str], bool]:
    deltas, hit = [], False
    for i, t in enumerate(ids):
        delta, hit = detok.add(t, final=i == len(ids) - 1)
        deltas.append(delta)
        if hit:
            break
    return deltas, hit


@pytest.mark.parametrize("which", ["hf", "byte"])
def test_characters_split_across_tokens_are_streamed_whole(hf, which):
    tok = hf if which == "hf" else ByteTokenizer()
    detok = Detokenizer(tok, ())
    assert isinstance(detok._step, WindowDecoder) == (which == "byte")  # DecodeStream for a checkpoint's tokenizer
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # some characters do span several tokens
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == TEXT == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_decode_stream_and_window_decoding_give_the_same_deltas(hf):
    ids = hf.encode(TEXT)
    window = WindowDecoder(hf)
    fast = hf.decode_stream()
    assert [window(t) for t in ids] == [fast(t) for t in ids]


@pytest.mark.parametrize("which", ["hf", "byte"])
def test_stop_string_across_tokens_is_held_back_and_cut(hf, which):
    tok = hf if which == "hf" else ByteTokenizer()
    detok = Detokenizer(tok, ("首都",))
    deltas, hit = stream(detok, tok.encode(TEXT))
    assert hit and "".join(deltas) == "naïve café 東京は日本の" == detok.text
    assert not any("首" in d for d in deltas)


def test_an_incomplete_character_at_the_end_is_flushed_as_replacement(hf):
    ids = hf.encode("ok 東")[:-1]  # the last character's final byte is missing
    deltas, _ = stream(Detokenizer(hf, ()), ids)
    assert "".join(deltas).startswith("ok ") and "".join(deltas).endswith("\ufffd")
    assert "".join(deltas[:-1]) == "ok "  # nothing of it was sent before the end


def test_deltas_add_up_to_the_text_when_a_stop_string_completed_before_min_tokens():
    """A stop string completed while min_tokens held the check back, and partly sent since, does not cut the
    text already streamed: the streamed deltas and the whole answer stay the same text."""
    tok = ByteTokenizer()
    detok = Detokenizer(tok, ("ab",))
    ids = tok.encode("xxabyy")
    deltas = [detok.add(t, final=False, check_stop=False)[0] for t in ids[:4]]
    assert "".join(deltas) == "xxa"  # "b" is held back: it could start a stop string
    deltas += [detok.add(ids[4], final=False)[0], detok.add(ids[5], final=True)[0]]
    assert "".join(deltas) == detok.text == "xxabyy"
