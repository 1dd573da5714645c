"""Decode attention alone: cairn's paged CPU op against the reference, and against the memory's read, in one run.

Per context length and batch: one attention layer's decode step of the Qwen3.5-0.8B shape (8 query heads, 2 KV
heads of 256, bf16, pages of 16 tokens) through the reference (`attention.paged_decode_attention`: the pages
gathered into a padded batch, or a view when one sequence's pages are consecutive, then SDPA) and through cairn's
op (`cpu_attention`: keys and values read in their pages), each sequence's pages scattered over the pool as a
long-running server's are (`--consecutive`: one run of ids, the reference's best case). Beside them the bytes of
keys and values the step must read and the time that takes at the memory's measured read (a plain `sum` over a
large tensor, the same run): "of read" is that floor over the op's time. Each point is the best of `--repeats`
alternating timings of the two. A benchmark, not a test: asserts nothing.

    PYTHONPATH=. python benchmarks/decode_attention_bench.py --contexts 512,4096,32768 --batches 1,16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.decode_bench import best_seconds, cpu_info, read_bandwidth_gbs
from cairn.ops import attention, cpu_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 256, 16


def point(batch: int, context: int, consecutive: bool, repeats: int, calls: int, bandwidth_gbs: float) -> dict:
    pages = -(-context // PAGE)
    gen = torch.Generator().manual_seed(0)
    shape = (batch * pages, PAGE, KV_HEADS, HEAD_DIM)
    k_pool, v_pool = torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16()
    ids = torch.arange(batch * pages) if consecutive else torch.randperm(batch * pages, generator=gen)
    tables, lens = ids.view(batch, pages), torch.full((batch,), context)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).bfloat16()
    sides = {"reference": attention.paged_decode_attention, "op": cpu_attention.paged_decode_attention}
    best = {name: float("inf") for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            fn(q, k_pool, v_pool, tables, lens, 0.0625)
            best[name] = min(best[name], best_seconds(lambda fn=fn: fn(q, k_pool, v_pool, tables, lens, 0.0625),
                                                      calls))
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    floor_s = kv_bytes / (bandwidth_gbs * 1e9)
    return {"batch": batch, "context": context, "consecutive": consecutive, "reference_ms": best["reference"] * 1e3,
            "op_ms": best["op"] * 1e3, "speedup": best["reference"] / best["op"], "kv_bytes": kv_bytes,
            "read_floor_ms": floor_s * 1e3, "of_read": floor_s / best["op"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="64,512,4096,32768", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--consecutive", action="store_true", help="each sequence's pages one run of ids")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds per point; the best is kept")
    ap.add_argument("--calls", type=int, default=5, help="timed calls per side and round")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write the rows and the machine as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.load_once():
        raise SystemExit(f"the op does not load here: {cpu_attention.load()}")
    buf = torch.ones(2**29 // 4)  # 512 MiB
    print(f"{cpu_info()['model']}, {args.threads} threads, op body {cpu_attention.vector_body(HEAD_DIM)}")
    print("| batch | context | reference ms | op ms | speedup | K+V MB | read GB/s | floor ms | of read |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            bandwidth = read_bandwidth_gbs(buf)
            row = point(batch, context, args.consecutive, args.repeats, args.calls, bandwidth)
            row["read_gbs"] = bandwidth
            rows.append(row)
            print(f"| {batch} | {context} | {row['reference_ms']:.3f} | {row['op_ms']:.3f} | {row['speedup']:.1f}x "
                  f"| {row['kv_bytes'] / 1e6:.1f} | {bandwidth:.1f} | {row['read_floor_ms']:.3f} "
                  f"| {row['of_read']:.0%} |", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": cpu_info(), "threads": args.threads, "time": time.time(),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
