"""Sampling parameters: greedy, temperature, top-k / top-p / min-p, seeds, stops, max_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from cairn.engine import LLM
from cairn.sampling import SamplingError, SamplingParams, _filter, sample

PROMPT = list(range(30, 60))


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4)


def test_same_seed_gives_the_same_tokens_and_other_seeds_differ(llm):
    p = lambda seed: SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
    a, b, c = (llm.generate(PROMPT, p(s))[0].token_ids for s in (1, 1, 2))
    assert a == b and a != c


def test_seeded_request_is_independent_of_its_batch_neighbours(llm):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].token_ids
    together = llm.generate([PROMPT, PROMPT[:10], PROMPT[5:]], params)
    assert together[0].token_ids == alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    topk1 = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    assert topk1[0].token_ids == greedy


def test_filters_keep_exactly_the_allowed_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda **kw: (_filter(logits, SamplingParams(temperature=1.0, **kw)) > 0).nonzero().flatten().tolist()
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.8) == [0, 1]
    assert kept(top_p=0.81) == [0, 1, 2]
    assert kept(min_p=0.3) == [0, 1, 2]
    assert kept(min_p=0.31) == [0, 1]


def test_logprob_is_that_of_the_chosen_token_under_the_model_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)] * 2, [None, None])
    assert [s.token for s in out] == [0, 2]
    assert math.isclose(out[0].logprob, torch.log_softmax(logits[0], -1)[0].item(), rel_tol=1e-6)
    assert [t for t, _ in out[1].top_logprobs] == [2, 0] or [t for t, _ in out[1].top_logprobs] == [2, 1]


def test_max_tokens_ends_with_length(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_id_ends_generation_and_is_not_in_the_text(llm):
    free = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                              stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(free.token_ids[:first])


def test_stop_string_truncates_the_text(llm):
    tok = llm.tokenizer
    ascii_prompt = tok.encode("The quick brown fox says")
    free = llm.generate(ascii_prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:5]
    out = llm.generate(ascii_prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert out.text == free.text[: free.text.index(stop)] and out.finish_reason == "stop"


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                dict(top_k=-2), dict(min_p=2), dict(stop=("",))])
def test_out_of_range_parameters_are_refused(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw)
