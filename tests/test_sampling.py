"""Sampling parameters: greedy, temperature, top-k / top-p / min-p, seeds, stops, max_tokens, logprobs,
penalties, logit_bias, min_tokens, include_stop_str_in_output, generation_config.json defaults, and the
sampler's numerical safety over every accepted value (hypothesis)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cairn.engine.llm import LLM
from cairn.errors import SamplingError
from cairn.request.logits import RowContext, process_rows
from cairn.request.sampling import _filter_rows, generation_defaults, sample, sample_isolated
from cairn.request.sampling_params import SamplingParams

PROMPT = list(range(30, 60))
VOCAB = 64


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
    kept = lambda **kw: (_filter_rows(logits[None], [SamplingParams(temperature=1.0, **kw)])[0][0] > 0
                         ).nonzero().flatten().tolist()
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
                                dict(top_k=-2), dict(min_p=2), dict(stop=("",)), dict(n=0), dict(n=17),
                                dict(presence_penalty=-2.1), dict(frequency_penalty=2.1),
                                dict(repetition_penalty=0.0), dict(repetition_penalty=2.5),
                                dict(logit_bias={1: 100.5}), dict(min_tokens=300), dict(min_tokens=-1),
                                dict(seed=2**64), dict(seed=-(2**63) - 1)])
def test_out_of_range_parameters_are_refused(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw)


# ---- numerical safety (issue 9 point 2) ----------------------------------------------------------

NORMAL = {"allow_subnormal": False}  # conftest (as the engine) flushes subnormal floats to zero
EXTREME_FLOATS = st.sampled_from([0.0, 1e-300, 1e-45, 1e-38, 1e-6, 1e-5, 0.5, 1.0])


@st.composite
def accepted_params(draw) -> SamplingParams:
    """Any SamplingParams the API accepts, biased to the edges of every range."""
    unit = lambda: st.one_of(EXTREME_FLOATS, st.floats(0.0, 1.0, **NORMAL))
    return SamplingParams(
        temperature=draw(st.one_of(EXTREME_FLOATS, st.floats(0.0, 100.0, **NORMAL), st.just(100.0))),
        top_p=max(draw(unit()), 1e-300),  # (0, 1]
        top_k=draw(st.integers(-1, 400)),
        min_p=draw(unit()),
        presence_penalty=draw(st.floats(-2.0, 2.0, **NORMAL)),
        frequency_penalty=draw(st.floats(-2.0, 2.0, **NORMAL)),
        repetition_penalty=max(draw(st.one_of(EXTREME_FLOATS, st.floats(0.0, 2.0, **NORMAL))), 1e-300),  # (0, 2]
        logit_bias=tuple(draw(st.lists(st.tuples(st.integers(0, VOCAB - 1), st.floats(-100.0, 100.0, **NORMAL)),
                                       max_size=4))),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))),
        logprobs=draw(st.booleans()), top_logprobs=draw(st.integers(0, 20)))


@st.composite
def logit_rows(draw) -> torch.Tensor:
    """A row of fp32 logits as a model can make them: finite, possibly huge, some tokens at -inf."""
    scale = draw(st.sampled_from([1e-30, 1.0, 30.0, 1e4, 1e30, 1e37]))
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31)))) * scale
    masked = draw(st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB // 2))
    row[masked] = float("-inf")
    row[draw(st.integers(0, VOCAB - 1))] = draw(st.sampled_from([0.0, 3e38, -3e38, 1.0]))
    return row


@st.composite
def contexts(draw) -> RowContext | None:
    if draw(st.booleans()):
        return None
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    banned = tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=8)))
    allowed = None
    if draw(st.booleans()):
        allowed = torch.zeros(VOCAB, dtype=torch.bool)
        allowed[draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))] = True
    return RowContext(ids, draw(st.integers(0, len(ids))), banned, allowed)


def _allowed(logits: torch.Tensor, ctx: RowContext | None) -> torch.Tensor:
    ok = logits > float("-inf")
    if ctx is not None:
        ok[list(ctx.banned)] = False
        if ctx.allowed is not None:
            ok &= ctx.allowed
    return ok


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(accepted_params(), logit_rows(), contexts()), min_size=1, max_size=4))
def test_sampler_never_raises_for_any_accepted_parameters(rows):
    params = [p for p, _, _ in rows]
    logits = torch.stack([r for _, r, _ in rows])
    ctxs = [c for _, _, c in rows]
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    out = sample(logits, params, gens, ctxs)
    for i, s in enumerate(out):
        ok = _allowed(logits[i], ctxs[i])
        if not ok.any():
            assert s.error is not None  # nothing may be chosen: this row fails, alone
            continue
        assert s.error is None and 0 <= s.token < VOCAB and bool(ok[s.token])
        if params[i].logprobs:
            assert s.logprob is not None and not math.isnan(s.logprob)


@pytest.mark.parametrize("kw", [dict(temperature=1e-45), dict(temperature=1e-300), dict(temperature=1e-6),
                                dict(temperature=1.0, top_p=1e-300), dict(temperature=100.0, min_p=1.0),
                                dict(temperature=1.0, top_p=1e-45, top_k=1)])
def test_tiny_temperature_or_top_p_samples_the_most_likely_token(kw):
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.9]])
    out = sample(logits, [SamplingParams(**kw)], [torch.Generator().manual_seed(0)])
    assert out[0].error is None and out[0].token == 1


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.tensor([[0.0, 1.0, 2.0], [5.0, 1.0, 0.0], [float("nan")] * 3])
    nothing = torch.zeros(3, dtype=torch.bool)
    ctxs = [None, RowContext([0], 1, allowed=nothing), None]
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams()],
                 [None] * 3, ctxs)
    assert out[0].error is None and out[0].token == 2
    assert out[1].error and out[2].error


# ---- penalties, bias, min_tokens, stop strings ----------------------------------------------------

def test_penalties_follow_vllm_definitions():
    """repetition over prompt + output (divide positive, multiply negative); frequency and presence over
    the output only."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0, 0.5]])
    ctx = RowContext(token_ids=[0, 1, 2, 2, 3], num_prompt_tokens=2)  # prompt [0, 1], output [2, 2, 3]
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5,
                       logit_bias=((4, 1.5),))
    got = process_rows(logits, [p], [ctx])[0]
    expected = torch.tensor([2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.25 * 2 - 0.5, 3.0 / 2 - 0.25 - 0.5, 0.5 + 1.5])
    assert torch.allclose(got, expected)


def test_rows_without_context_are_not_processed():
    logits = torch.tensor([[2.0, 1.0], [0.0, 1.0]])
    got = process_rows(logits, [SamplingParams(), SamplingParams(logit_bias=((0, 5.0),))],
                       [None, RowContext([1], 1)])
    assert set(got) == {1} and got[1].tolist() == [5.0, 1.0] and logits[1].tolist() == [0.0, 1.0]


def test_logit_bias_can_force_a_token(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.8, seed=1, logit_bias={65: 100.0},
                                              ignore_eos=True))[0]
    assert out.token_ids == [65] * 4 and out.text == "AAAA"


def test_presence_penalty_changes_greedy_output_away_from_repeats(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    penalized = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    presence_penalty=2.0, frequency_penalty=2.0,
                                                    repetition_penalty=2.0))[0].token_ids
    assert plain != penalized
    assert len(set(penalized)) >= len(set(plain))


def test_min_tokens_holds_back_end_of_sequence(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    forced = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
    assert llm.generate(PROMPT, forced)[0].token_ids == [eos]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0},
                                              min_tokens=5))[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    prompt = llm.tokenizer.encode("The quick brown fox says")
    free = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[3:5]
    kept = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,),
                                               include_stop_str_in_output=True))[0]
    cut = free.text.index(stop)
    assert kept.text == free.text[: cut + len(stop)] and kept.finish_reason == "stop"


def test_include_stop_str_in_output_keeps_a_stop_token_ids_text_unless_it_is_a_special_token(llm):
    """As vLLM: a stop token's text is cut like a stop string's, and kept with include_stop_str_in_output (an
    end-of-sequence special token never shows). cairn dropped it even then."""
    prompt = llm.tokenizer.encode("The quick brown fox says")
    free = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    at, token = next((i, t) for i, t in enumerate(free.token_ids) if i >= 2 and 32 < t < 127)  # a printable byte
    eos = llm.tokenizer.eos_token_ids[0]
    for include in (False, True):
        out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=(token,), include_stop_str_in_output=include))[0]
        assert out.token_ids == free.token_ids[: at + 1] and out.finish_reason == "stop"
        assert out.text == llm.tokenizer.decode(free.token_ids[: at + include])
        forced = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, logit_bias={eos: 100.0},
                                                     include_stop_str_in_output=include))[0]
        assert forced.token_ids == [eos] and forced.text == ""


def test_stop_strings_wait_for_min_tokens(llm):
    prompt = llm.tokenizer.encode("The quick brown fox says")
    free = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[1:2]
    early = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    late = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,),
                                               min_tokens=12))[0]
    assert len(late.token_ids) >= 12 > len(early.token_ids)


# ---- generation_config.json defaults -------------------------------------------------------------

def test_generation_config_defaults_are_read_and_out_of_range_ones_ignored(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
         "max_new_tokens": 99}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                             "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    assert generation_defaults(tmp_path) == {}
    assert generation_defaults(tmp_path / "missing") == {}


def test_a_row_whose_parameters_raise_fails_alone_and_its_neighbours_are_sampled():
    """`sample_isolated` (the engine's sampler): a row whose parameters raise (here more top_logprobs than the
    vocabulary has tokens) comes back with `error`; the batch's other rows get the tokens `sample` gives them."""
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0], [1.5, 0.2, 0.1, 0.0], [0.0, 0.1, 0.2, 3.0]])
    ok = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    bad = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)
    rows = sample_isolated(logits, [ok, bad, ok], [None, None, None])
    assert rows[1].error and rows[1].error.startswith("sampling failed: RuntimeError")
    assert [r.error for r in (rows[0], rows[2])] == [None, None]
    assert [rows[0], rows[2]] == sample(logits[[0, 2]], [ok, ok], [None, None])
    assert [rows[0].token, rows[2].token] == [1, 3]


def test_unreadable_generation_config_gives_no_defaults_and_says_so(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6,')  # cut short
    with caplog.at_level(logging.WARNING, logger="cairn.sampling"):
        assert generation_defaults(tmp_path) == {}
    assert any("unreadable" in r.getMessage() and "no sampling defaults" in r.getMessage() for r in caplog.records)


def test_a_greedy_row_that_cannot_be_sampled_fails_alone():
    """Greedy rows take their own path (an argmax, no draw): a row of NaN logits, or one whose every token is
    masked, gets the error; its greedy neighbour gets its token."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan")] * 3, [5.0, 1.0, 0.0]])
    nothing = torch.zeros(3, dtype=torch.bool)
    greedy = SamplingParams(temperature=0.0)
    out = sample(logits, [greedy] * 3, [None] * 3, [None, None, RowContext([0], 1, allowed=nothing)])
    assert out[0].error is None and out[0].token == 2
    assert "not finite" in out[1].error and "masked" in out[2].error
