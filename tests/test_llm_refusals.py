"""The offline API's refusals (`cairn.LLM`, issue 11's fifth coverage pass): input that can never run
is refused when it is queued, with the error a caller catches, and the engine keeps generating. The
server checks the same things itself before they reach the engine; these are the engine's own checks,
which only the Python API reaches."""

from __future__ import annotations

import logging

import pytest

from cairn.engine.llm import LLM
from cairn.errors import ChatTemplateError, RequestTooLarge, SamplingError
from cairn.request.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(kv_cache_gib=0.02, state_cache_gib=0.02) as model:
        yield model


def test_unknown_engine_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"unknown engine options: \['kv_cache_gb'\]"):
        LLM(kv_cache_gb=1)


def test_prompt_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestTooLarge, match=rf"prompt token ids must be in \[0, {vocab}\)"):
        llm.generate([1, 2, vocab])
    assert llm.generate([1, 2, 3], GREEDY)[0].token_ids


def test_stop_token_id_outside_the_vocabulary_is_refused(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(SamplingError, match="stop_token_ids must be in"):
        llm.generate("hi", SamplingParams(stop_token_ids=[vocab + 5]))


def test_text_prompt_longer_than_the_context_is_refused(llm):
    with pytest.raises(RequestTooLarge):
        llm.generate("x" * (llm.engine.max_model_len + 1))
    surely = llm.engine.tokenizer.max_chars_per_token * llm.engine.max_model_len + 1  # refused before encoding
    with pytest.raises(RequestTooLarge, match=f"\\({surely} characters\\)"):
        llm.generate("x" * surely)
    assert llm.generate("x", GREEDY)[0].token_ids


def test_one_stop_string_given_alone_stops_like_a_list_of_one(llm):
    free = llm.generate("Once", GREEDY)[0].text
    stop = free[3:5]
    assert stop and free.index(stop) < len(free) - len(stop)
    alone = llm.generate("Once", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=stop))[0]
    assert alone.text == free[:free.index(stop)]
    assert SamplingParams(stop=stop).stop == (stop,)  # a str is one stop string, not a set of characters


def test_a_refused_prompt_in_a_list_leaves_no_earlier_prompt_queued(llm):
    """generate([ok, refused]): the refusal is raised and the prompts queued before it are aborted, not
    left to run (unread) inside the next call's batch."""
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestTooLarge):
        llm.generate(["hello", [1, vocab]], GREEDY)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ChatTemplateError):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "nobody", "content": 5}]], GREEDY)
    assert not llm.engine.has_unfinished()
    assert [len(c.token_ids) for c in llm.generate(["a", "b"], GREEDY)] == [12, 12]


def test_half_precision_with_no_room_for_a_prefill_block_says_resumes_match_only_within_rounding(caplog):
    """bfloat16 with a step budget too small for one 64-token prefill block next to every decode row: the
    engine runs (no exact-resumption block) and says what that costs."""
    with caplog.at_level(logging.WARNING, logger="cairn.engine"), LLM(
            dtype="bfloat16", max_num_batched_tokens=64, max_num_seqs=4, kv_cache_gib=0.02,
            state_cache_gib=0.02) as small:
        assert small.engine.prefill_block == 0
        assert small.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    assert any("leaves no room for a 64-token prefill block" in r.getMessage() for r in caplog.records)


def test_checkpoint_without_its_tokenizer_is_refused_by_the_python_api(tmp_path):
    """`cairn serve` refuses it before loading (preflight); LLM(model=...) names the missing file too."""
    import shutil

    from tests.checkpoints import write_checkpoint

    write_checkpoint("qwen3_5_text", tmp_path / "ckpt")
    shutil.copytree(tmp_path / "ckpt", tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        LLM(model=str(tmp_path / "m"), kv_cache_gib=0.02, state_cache_gib=0.02)
