"""Does one constrained (response_format) request slow the unconstrained requests of its batch?

Two measurements, each alternating its variants run after run so that machine noise hits them alike:

1. engine: the decode step time of the demo model (random weights, byte tokenizer) with 8
   unconstrained greedy requests plus a 9th that is either unconstrained too or constrained by a JSON
   schema (llguidance mask computed every step). The 9th row is there in both variants, so the
   difference is the grammar's cost alone (mask, its application, accepting the token).
2. sampler: `sample()` alone on a batch of 8 rows at a real vocabulary size (151,936, Qwen's), with
   and without one row carrying an allowed-token mask and a repetition penalty; the mask is a random
   one (llguidance needs the real tokenizer to build it), so this is the sampler's side of the cost.

    PYTHONPATH=. python benchmarks/structured_bench.py --runs 5

This is a benchmark, not a test: it asserts nothing and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cairn.engine.llm import LLM
from cairn.request.logits import RowContext
from cairn.request.sampling import sample
from cairn.request.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 400}}, "required": ["answer"]}


def engine_step_s(llm: LLM, constrained: bool, num_steps: int) -> float:
    """Median decode step time of 8 free requests + one (constrained or not) in the same batch."""
    engine = llm.engine
    free = SamplingParams(max_tokens=num_steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(list(range(30 + i, 60 + i)), free)
    ninth = SamplingParams(max_tokens=num_steps + 4, temperature=0.0, ignore_eos=True,
                           structured=StructuredOutput("json_schema", json.dumps(SCHEMA)) if constrained else None)
    engine.add_request(list(range(10, 40)), ninth)
    engine.step()  # prefill every prompt (one batch)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def sampler_s(vocab: int, constrained: bool, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, vocab, generator=gen)
    params = [SamplingParams(temperature=0.0)] * 8 + [SamplingParams(temperature=0.0, repetition_penalty=1.1)]
    contexts = None
    if constrained:
        allowed = torch.rand(vocab, generator=gen) < 0.01
        contexts = [None] * 8 + [RowContext(list(range(0, 4000, 7)), 500, allowed=allowed)]
    else:
        params[8] = SamplingParams(temperature=0.0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample(logits, params, [None] * 9, contexts)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(kv_cache_gib=0.1, state_cache_gib=0.1, max_num_seqs=9)
    engine_step_s(llm, False, 4)  # warm-up
    engine_runs: dict[bool, list[float]] = {False: [], True: []}
    sampler_runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.runs):
        for constrained in (False, True):
            engine_runs[constrained].append(engine_step_s(llm, constrained, args.steps))
            sampler_runs[constrained].append(sampler_s(151_936, constrained, 20))
    print("| measurement | 9 unconstrained | 8 + 1 constrained | ratio |")
    print("|---|---|---|---|")
    for name, runs in (("decode step, demo model, batch 9 (ms)", engine_runs),
                       ("sample(), 9 rows x 151,936 vocab (ms)", sampler_runs)):
        free, con = statistics.median(runs[False]) * 1e3, statistics.median(runs[True]) * 1e3
        print(f"| {name} | {free:.2f} | {con:.2f} | {con / free:.2f} |")


if __name__ == "__main__":
    main()
