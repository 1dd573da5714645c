"""How long does a step beside a decoding stream last while a long prompt prefills? The engine (demo model,
or --model) runs one decoding stream, then takes a --tokens prompt; each step's CPU time is measured on one
thread (so that other work on the machine changes it little), with the scheduler's depth-aware chunks
(the default) and without (attention_break_even = 0: every chunk the full budget), side by side.

    python -m benchmarks.deep_prefill_bench                       # demo model, float32 and bfloat16, 40000 tokens
    python -m benchmarks.deep_prefill_bench --tokens 20000 --dtypes bfloat16 --model /path/to/checkpoint

Reports per dtype and mode: steps, the stream's tokens while the prompt prefilled, the largest step and the
median step (CPU s), the prompt's total CPU time and its wall time. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.decode_bench import cpu_info
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams


def measure(model: str | None, dtype: str, tokens: int, budget: int, shorten: bool) -> dict:
    llm = LLM(model, dtype=dtype, max_num_batched_tokens=budget)
    engine = llm.engine
    break_even = engine.scheduler.attention_break_even
    if not shorten:
        engine.scheduler.attention_break_even = 0
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=tokens, ignore_eos=True))
    for _ in range(3):
        engine.step()
    prompt = [(13 * i) % 200 + 1 for i in range(tokens)]
    engine.add_request(prompt, SamplingParams(max_tokens=1, cache_prompt=False))
    steps, wall0 = [], time.perf_counter()
    while len(engine.scheduler.running) + len(engine.scheduler.waiting) > 1:
        t = time.thread_time()
        engine.step()
        steps.append(time.thread_time() - t)
    wall = time.perf_counter() - wall0
    llm.close()
    return {"break_even": break_even, "steps": len(steps), "max_s": max(steps), "median_s": statistics.median(steps),
            "cpu_s": sum(steps), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the demo model)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} ({' '.join(cpu['flags'])}); torch threads 1; prompt {args.tokens} tokens beside "
          f"one decoding stream; budget {args.budget}")
    print("| dtype | chunks | break-even | steps (= stream tokens) | largest step | median step | prompt CPU "
          "| prompt wall |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for shorten in (False, True):
            r = measure(args.model, dtype, args.tokens, args.budget, shorten)
            print(f"| {dtype} | {'depth-aware' if shorten else 'full budget'} | {r['break_even']} | {r['steps']} | "
                  f"{r['max_s']:.2f} s | {r['median_s']:.2f} s | {r['cpu_s']:.1f} s | {r['wall_s']:.1f} s |",
                  flush=True)


if __name__ == "__main__":
    main()
