"""Device-tier prefix cache figures, measured side by side in one run (a benchmark, not a test).

1. Taking and restoring a snapshot against its bytes, beside a plain tensor copy of the same bytes.
2. Cold-prefill overhead of taking snapshots at the default interval (cache on vs off, same prompt).
   "Off" is the same engine with the request opted out of the cache (`cache_prompt=False`), so both
   sides run on the same weights in the same memory. A full-length prefill runs first as a warm-up:
   the first one pays page faults on its large buffers (seen: 46 s against 38 s for the next).
3. Time to first token of a compaction replay (the conversation cut far back plus a new instruction):
   warm (resumed from the cache) vs cold, against prefilling the new suffix alone.

    python benchmarks/cache_bench.py --size 0.8b --context 4096 --out benchmarks/out/cache_bench.json

Sizes as in engine_throughput.py (random weights; `0.8b` has the Qwen3.5-0.8B dimensions).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_throughput import prompt, spread
from cairn.bench.checkpoint import make_checkpoint


def engine(path: Path, context: int, interval: int):
    from cairn.config import CacheOptions, EngineConfig, MemoryOptions, ModelOptions, SchedulerOptions
    from cairn.engine.engine import Engine

    cfg = EngineConfig(ModelOptions(model=str(path), dtype="float32", device="cpu"),
                       MemoryOptions(page_size=16, kv_cache_gib=1.0, state_cache_gib=0.25),
                       SchedulerOptions(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=context + 512),
                       CacheOptions(prefix_cache=True, snapshot_interval=interval, device_snapshot_gib=2.0,
                                    host_cache_gib=0.0))
    return Engine(cfg, show_progress=False)


def ttft_s(eng, ids: list[int], cache: bool = True):
    from cairn.request.sampling_params import SamplingParams

    t0 = time.perf_counter()
    eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, cache_prompt=cache))
    out = None
    while eng.has_unfinished():
        out = next((o for o in eng.step() if o.finished), out)
    return time.perf_counter() - t0, out


def snapshot_copy_figures(eng, repeats: int = 20) -> dict:
    tier, states = eng.cache.tiers.device, eng.states
    slot = states.alloc()
    stored = tier.store(states, slot, None)
    t0 = time.perf_counter()
    for _ in range(repeats):
        tier.free_snapshot(tier.store(states, slot, None))
    take_s = (time.perf_counter() - t0) / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        tier.load_snapshot(stored, states, slot)
    restore_s = (time.perf_counter() - t0) / repeats
    nbytes = stored.nbytes
    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    memcpy_s = (time.perf_counter() - t0) / repeats
    tier.free(stored)
    states.free(slot)
    return {"snapshot_bytes": nbytes, "take_s": take_s, "restore_s": restore_s, "plain_copy_s": memcpy_s,
            "take_GBps": nbytes / take_s / 1e9, "restore_GBps": nbytes / restore_s / 1e9,
            "plain_copy_GBps": nbytes / memcpy_s / 1e9}


def run(size: str, context: int, interval: int, keep: int, instruction: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint(size, Path(d))
        warm = engine(Path(d), context, interval)
        ttft_s(warm, prompt(context, seed=99), cache=False)  # warm-up at full length
        row = {"size": size, "context": context, "interval": interval}
        row.update(snapshot_copy_figures(warm))
        conversation, other = prompt(context, seed=1), prompt(context, seed=5)
        off, on = [], []
        for ids in (conversation, other):  # alternate the two sides; the best of two each
            off.append(ttft_s(warm, ids, cache=False)[0])
            seconds, first = ttft_s(warm, ids)
            on.append(seconds)
        row["cold_prefill_cache_off_s"], row["cold_prefill_cache_on_s"] = min(off), min(on)
        row["cold_prefill_cache_off_runs"], row["cold_prefill_cache_on_runs"] = off, on
        row["snapshots_taken"] = first.cache.snapshots_taken
        row["snapshot_overhead"] = row["cold_prefill_cache_on_s"] / row["cold_prefill_cache_off_s"] - 1
        replay = conversation[:keep] + prompt(instruction, seed=2)
        row["replay_warm_s"], out = ttft_s(warm, replay)
        row["replay_cold_s"], _ = ttft_s(warm, replay, cache=False)
        row["replay_resume_position"] = out.cache.resume_position
        suffix = replay[out.cache.resume_position:]
        row["suffix_tokens"] = len(suffix)
        row["suffix_alone_s"], _ = ttft_s(warm, suffix, cache=False)
        row["warm_over_suffix_alone"] = row["replay_warm_s"] / row["suffix_alone_s"]
        row["cold_over_warm"] = row["replay_cold_s"] / row["replay_warm_s"]
        return row


def report(r: dict) -> str:
    return "\n".join([
        f"size {r['size']}, context {r['context']} tokens, snapshot every {r['interval']} tokens",
        "",
        "| figure | value |", "|---|---:|",
        f"| snapshot bytes | {r['snapshot_bytes'] / 2**20:.2f} MiB |",
        f"| take a snapshot | {r['take_s'] * 1e3:.2f} ms ({r['take_GBps']:.1f} GB/s) |",
        f"| restore a snapshot | {r['restore_s'] * 1e3:.2f} ms ({r['restore_GBps']:.1f} GB/s) |",
        f"| plain copy of the same bytes | {r['plain_copy_s'] * 1e3:.2f} ms ({r['plain_copy_GBps']:.1f} GB/s) |",
        f"| cold prefill, cache off (best; spread) | {r['cold_prefill_cache_off_s']:.2f} s "
        f"({spread(r['cold_prefill_cache_off_runs'])} s) |",
        f"| cold prefill, cache on ({r['snapshots_taken']} snapshots; best; spread) | "
        f"{r['cold_prefill_cache_on_s']:.2f} s ({spread(r['cold_prefill_cache_on_runs'])} s) |",
        f"| snapshot overhead on cold prefill | {100 * r['snapshot_overhead']:+.1f}% (target <= 3%) |",
        f"| compaction replay TTFT, cold | {r['replay_cold_s']:.2f} s |",
        f"| compaction replay TTFT, warm (resume at {r['replay_resume_position']}) | {r['replay_warm_s']:.2f} s |",
        f"| prefill of the {r['suffix_tokens']}-token suffix alone | {r['suffix_alone_s']:.2f} s |",
        f"| warm / suffix alone | {r['warm_over_suffix_alone']:.2f}x (target <= 1.2x) |",
        f"| cold / warm | {r['cold_over_warm']:.1f}x |",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.8b")
    ap.add_argument("--context", type=int, default=4096, help="tokens in the cached conversation")
    ap.add_argument("--interval", type=int, default=1024, help="snapshot interval (the default is 1024)")
    ap.add_argument("--keep", type=int, default=None, help="tokens of the conversation the replay keeps")
    ap.add_argument("--instruction", type=int, default=64, help="tokens of the new instruction")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    keep = args.keep if args.keep is not None else int(args.context * 0.7) + 5
    row = run(args.size, args.context, args.interval, keep, args.instruction)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU\n")
    print(report(row))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
