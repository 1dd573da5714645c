"""The repetition, frequency and presence penalties read, at each step, only the tokens a sequence appended since
the step before (cairn.request.logits.PenaltyCounts): converting its whole prompt and output every step cost 9 ms
per row at 60k tokens, on the engine thread every other stream waits behind. Kept step by step, they change the
logits exactly as counting afresh does."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from cairn.engine.llm import LLM
from cairn.request.logits import RowContext, process_rows
from cairn.request.sampling_params import SamplingParams

PENALIZED = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.5, presence_penalty=0.25)


def test_penalties_convert_each_token_once_not_the_whole_context_every_step(monkeypatch):
    prompt = [(7 * j) % 250 for j in range(600)]
    converted = []  # the number of elements of each torch.tensor(list) made by cairn.request.logits
    real = torch.tensor

    def counting(data, *args, **kwargs):
        if isinstance(data, list) and sys._getframe(1).f_code.co_filename.endswith("logits.py"):
            converted.append(len(data))
        return real(data, *args, **kwargs)

    with LLM(kv_cache_gib=0.02, state_cache_gib=0.02, max_num_seqs=2, prefix_cache=False) as llm:
        monkeypatch.setattr(torch, "tensor", counting)
        out = llm.generate([prompt], PENALIZED)[0]
    assert len(out.token_ids) == 60
    # each token converted at most twice (once as seen, once as output), not the context at every step (36,000+)
    assert sum(converted) <= 2 * (len(prompt) + 60)


@pytest.mark.parametrize("seed", range(5))
def test_penalty_counts_kept_step_by_step_change_the_logits_as_counting_afresh(seed):
    from cairn.request.logits import PenaltyCounts

    rng = random.Random(seed)
    vocab = 50
    params = [SamplingParams(repetition_penalty=rng.choice([1.0, 0.7, 1.5]), frequency_penalty=rng.choice([0, 0.5]),
                             presence_penalty=rng.choice([0, -1.0]), logit_bias={3: 2.0}) for _ in range(3)]
    ids = [[rng.randrange(-2, vocab + 3) for _ in range(rng.randrange(1, 30))] for _ in range(3)]  # a few out of range
    num_prompt = [len(x) for x in ids]
    kept = [PenaltyCounts() for _ in range(3)]
    for _ in range(40):
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        stepwise = process_rows(logits, params, [RowContext(x, n, penalty=k) for x, n, k in zip(ids, num_prompt, kept,
                                                                                                 strict=True)])
        afresh = process_rows(logits, params, [RowContext(list(x), n) for x, n in zip(ids, num_prompt, strict=True)])
        for i in range(3):
            assert torch.equal(stepwise[i], afresh[i])
        for x in ids:  # one token, sometimes several (a step may append more than one)
            x.extend(rng.randrange(-1, vocab + 1) for _ in range(rng.choice([1, 1, 1, 3])))
