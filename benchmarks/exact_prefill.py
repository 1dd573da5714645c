"""Exact resumption in half precision: its prefill cost and whether warm equals cold, in one run.

For each size (the engine_throughput sizes: `tiny`, and `0.8b` = the Qwen3.5-0.8B dimensions with a 32k
vocabulary) and each dtype, two engines on the same random weights, one with `prefill_block=0` (one
model call per step, resume anywhere) and one with the block (default 512), alternate cold prefills of
the same prompts; the table gives the best tokens/s of each and their ratio. Then, per block setting,
a conversation is prefilled, a longer prompt sharing most of it is resumed from the cache, and its
first-token logits are compared with a cold engine's, bit for bit (`torch.equal`) and by the largest
difference.

    python benchmarks/exact_prefill.py --sizes tiny,0.8b --dtypes bfloat16 --out benchmarks/out/exact_prefill.json

A benchmark, not a test: it asserts nothing and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_throughput import prompt
from cairn.bench.checkpoint import make_checkpoint


def engine(path: Path, dtype: str, block: int, cache: bool):
    from cairn.config import CacheOptions, EngineConfig, MemoryOptions, ModelOptions, SchedulerOptions
    from cairn.engine.engine import Engine

    cfg = EngineConfig(ModelOptions(model=str(path), dtype=dtype, device="cpu"),
                       MemoryOptions(page_size=16, kv_cache_gib=0.5, state_cache_gib=0.5),
                       SchedulerOptions(max_num_seqs=8, max_num_batched_tokens=2048, prefill_block=block),
                       CacheOptions(prefix_cache=cache, snapshot_interval=1024, device_snapshot_gib=0.5))
    return Engine(cfg, show_progress=False)


def first_logits(eng, ids: list[int]) -> tuple[torch.Tensor, int]:
    """The logits that pick the first generated token (recorded from the runner), and the resume position."""
    from cairn.request.sampling_params import SamplingParams

    seen: list[torch.Tensor] = []
    run = eng.runner.run

    def recording(batch):
        logits, sampled = run(batch)
        seen.extend(logits[i] for i, s in enumerate(sampled) if s.num_output_tokens == 0)
        return logits, sampled

    eng.runner.run = recording
    rid = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
    resume = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                resume = out.cache.resume_position if out.cache else 0
    eng.runner.run = run
    return seen[-1], resume


def warm_vs_cold(path: Path, dtype: str, block: int, history_len: int = 1500) -> dict:
    warm, cold = engine(path, dtype, block, True), engine(path, dtype, block, False)
    history = prompt(history_len, seed=1)
    first_logits(warm, history)
    longer = history + prompt(history_len // 5, seed=2)  # the append pattern: resumes at the history's end
    w, resume = first_logits(warm, longer)
    c, _ = first_logits(cold, longer)
    return {"block": warm.prefill_block, "resume": resume, "equal": bool(torch.equal(w, c)),
            "max_abs_diff": float((w - c).abs().max())}


def prefill_tok_s(eng, n: int, seed: int) -> float:
    from cairn.request.sampling_params import SamplingParams

    t0 = time.perf_counter()
    eng.add_request(prompt(n, seed=seed), SamplingParams(max_tokens=1, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    return n / (time.perf_counter() - t0)


def run_size(size: str, dtype: str, block: int, n: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint(size, Path(d))
        plain, exact = engine(Path(d), dtype, 0, False), engine(Path(d), dtype, block, False)
        prefill_tok_s(plain, 64, 0), prefill_tok_s(exact, 64, 0)  # warm-up
        runs = {"plain": [], "exact": []}
        for i in range(repeats):  # alternating, same prompts
            runs["plain"].append(prefill_tok_s(plain, n, i))
            runs["exact"].append(prefill_tok_s(exact, n, i))
        del plain, exact
        row = {"size": size, "dtype": dtype, "tokens": n, "block": block,
               "plain_tok_s": max(runs["plain"]), "exact_tok_s": max(runs["exact"])}
        row["checks"] = [warm_vs_cold(Path(d), dtype, b) for b in (0, block)]
        return row


def table(rows: list[dict]) -> str:
    lines = ["| size | dtype | prefill tokens | block 0 tok/s | block tok/s | ratio | warm == cold (block 0) "
             "| warm == cold (block) |", "|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        checks = [f"{'yes' if c['equal'] else 'no'} (resume {c['resume']}, max diff {c['max_abs_diff']:.2g})"
                  for c in r["checks"]]
        lines.append(f"| {r['size']} | {r['dtype']} | {r['tokens']} | {r['plain_tok_s']:.1f} | "
                     f"{r['exact_tok_s']:.1f} (block {r['block']}) | {r['exact_tok_s'] / r['plain_tok_s']:.2f}x | "
                     f"{checks[0]} | {checks[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    rows = [run_size(s, d, args.block, args.tokens, args.repeats)
            for s in args.sizes.split(",") for d in args.dtypes.split(",")]
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
