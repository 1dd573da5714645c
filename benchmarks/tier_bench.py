"""Tier figures, measured side by side in one run (a benchmark, not a test).

1. Restore bandwidth per tier (a snapshot copied into a working slot), against a plain copy of the same
   bytes: a tensor copy for device and host, reading the segment file for disk (target >= 50%); the
   median of 7 of each, the page cache dropped before every disk restore and read.
2. Time to first token resuming one conversation from device, host and disk, against a cold prefill;
   with several `--contexts`, once per conversation length, and `--plot` draws time to first token
   against context length per resume tier.
3. After a restart (the conversation on disk alone), three follow-ups of 4 new tokens in a row: the
   first reads the disk and puts the prefix back on the device, so the next ones resume from there;
   beside the same three with that promotion turned off (each reads the disk).

    python benchmarks/tier_bench.py --size 0.8b --contexts 2048 --out benchmarks/out/tier_bench.json
    python benchmarks/tier_bench.py --size tiny --contexts 1024,2048,4096,8192 --plot benchmarks/figures/ttft_tiers.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cache_bench import ttft_s
from benchmarks.engine_throughput import prompt
from cairn.bench.checkpoint import make_checkpoint


def disk_options(disk: str | None) -> dict:
    """The disk tier's fields: an 8 GiB budget written at eviction, not through (none without a directory: the
    options refuse a disk flag without the tier)."""
    return {} if disk is None else {"disk_cache": disk, "disk_cache_gib": 8.0, "disk_write_through": False}


def engine(path: Path, disk: str | None, context: int, prefix_cache: bool = True):
    from cairn.config import CacheOptions, EngineConfig, MemoryOptions, ModelOptions, SchedulerOptions
    from cairn.engine.engine import Engine

    cfg = EngineConfig(ModelOptions(model=str(path), dtype="float32", device="cpu"),
                       MemoryOptions(page_size=16, kv_cache_gib=1.0, state_cache_gib=0.25),
                       SchedulerOptions(max_num_seqs=2, max_num_batched_tokens=2048, max_model_len=context + 256),
                       CacheOptions(prefix_cache=prefix_cache, snapshot_interval=512, device_snapshot_gib=1.0,
                                    host_cache_gib=2.0, **disk_options(disk)))
    return Engine(cfg, show_progress=False)


def force_tier(eng, tier: str) -> None:
    """Move every snapshot and every node's KV down to `tier` (demoting, or dropping faster copies)."""
    tiers, tree = eng.cache.tiers, eng.cache.tree
    above = tiers.tiers[: tiers.names.index(tier)]
    for _, entry, node in list(tree.iter_snapshots()):
        for t in above:
            if t.name in entry.handle.copies:
                tiers.demote_snapshot(node, t)
    for node in list(tree.iter_nodes()):
        for t in above:
            if t.name in node.kv:
                tiers._demote_kv(node, t, {})
            if t.name in node.kv and len(node.kv) > 1:
                tree.drop_kv(node, t.name)


def _drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages, so that both reads come from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def restore_figures(eng, disk_root: str, repeats: int = 7) -> dict:
    """Median of `repeats` restores per tier, each beside a plain copy / read of the same bytes."""
    tiers, states = eng.cache.tiers, eng.states
    _, entry, _ = max(eng.cache.tree.iter_snapshots(), key=lambda x: x[0])
    handle, slot = entry.handle, states.alloc()
    rows = {}
    for tier in ("device", "host", "disk"):
        force_tier(eng, tier)
        nbytes = entry.nbytes
        if tier == "disk":
            path = next(Path(disk_root).glob(f"*/{handle.copies['disk'].hex()}.seg"))
            nbytes = path.stat().st_size
        else:
            pool = tiers.by_name[tier].pool
            src = list(pool.read_slot(handle.copies[tier].slot).values())
            dst = [torch.empty_like(t) for t in src]
            _copy_all(dst, src)  # touch the destination first, as the restore's destination slot already is
        restores, plains = [], []
        for _ in range(repeats):
            if tier == "disk":
                _drop_page_cache(path)
            start = time.perf_counter()
            tiers.restore_snapshot(handle, tier, states, slot)
            restores.append(time.perf_counter() - start)
            if tier == "disk":
                _drop_page_cache(path)
                start = time.perf_counter()
                path.read_bytes()
                plains.append(time.perf_counter() - start)
            else:
                start = time.perf_counter()
                _copy_all(dst, src)
                plains.append((time.perf_counter() - start) * entry.nbytes / sum(t.nbytes for t in src))
        seconds, plain = statistics.median(restores), statistics.median(plains)
        rows[tier] = {"bytes": nbytes, "restore_s": seconds, "plain_s": plain, "ratio": plain / seconds,
                      "restore_runs_s": restores}
    states.free(slot)
    return rows


def run(size: str, context: int) -> dict:
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as disk:
        make_checkpoint(size, Path(d))
        warm, cold = engine(Path(d), disk, context), engine(Path(d), None, context, prefix_cache=False)
        ttft_s(warm, prompt(64, seed=9)), ttft_s(cold, prompt(64, seed=9))  # warm-up
        conversation = prompt(context, seed=1)
        ttft_s(warm, conversation)
        result = {"size": size, "context": context}
        result["cold_s"], _ = ttft_s(cold, conversation + prompt(32, seed=3))
        for i, tier in enumerate(("device", "host", "disk")):  # each follow-up branches off at the conversation end
            force_tier(warm, tier)
            result[f"{tier}_s"], out = ttft_s(warm, conversation + prompt(32, seed=10 + i))
            result[f"{tier}_resume"] = (out.cache.resume_position, out.cache.resume_tier)
        result["restore"] = restore_figures(warm, disk)
        for promote in (True, False):
            warm.cache.promote_resumed = promote
            force_tier(warm, "disk")  # what a restart leaves: the conversation on disk alone
            result[f"after_restart_promote_{promote}"] = [  # new follow-ups each: none resumes another's end
                (seconds, out.cache.resume_tier, out.cache.resume_position) for seconds, out in
                (ttft_s(warm, conversation + prompt(4, seed=20 + 3 * promote + i)) for i in range(3))]
        return result


def report(r: dict) -> str:
    lines = [f"size {r['size']}, conversation of {r['context']} tokens, follow-up of 32 new tokens", "",
             "| tier | bytes | restore (median; spread) | plain copy / file read | restore speed vs plain |",
             "|---|---:|---:|---:|---:|"]
    for tier, row in r["restore"].items():
        runs_ms = [x * 1e3 for x in row["restore_runs_s"]]
        lines.append(f"| {tier} | {row['bytes'] / 2**20:.2f} MiB | {row['restore_s'] * 1e3:.2f} ms "
                     f"({min(runs_ms):.2f}-{max(runs_ms):.2f}) | "
                     f"{row['plain_s'] * 1e3:.2f} ms | {100 * row['ratio']:.0f}% |")
    lines += ["", "| resume from | time to first token | vs cold |", "|---|---:|---:|",
              f"| cold prefill | {r['cold_s']:.3f} s | 1.0x |"]
    for tier in ("device", "host", "disk"):
        pos, got = r[f"{tier}_resume"]
        lines.append(f"| {tier} (resumed {pos} tokens from {got}) | {r[f'{tier}_s']:.3f} s | "
                     f"{r['cold_s'] / r[f'{tier}_s']:.1f}x faster |")
    lines += ["", "After a restart (on disk alone), three follow-ups of 4 new tokens in a row: time to first token "
              "(tokens resumed)",
              "", "| what a resume reads from disk | 1st | 2nd | 3rd |", "|---|---:|---:|---:|"]
    for promote, label in ((True, "put back on the device"), (False, "left on disk")):
        runs = r[f"after_restart_promote_{promote}"]
        lines.append(f"| {label} | " + " | ".join(f"{s:.3f} s ({pos} from {tier})" for s, tier, pos in runs) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Time to first token against context length: cold prefill and each resume tier (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [r["context"] for r in results]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("cold_s", "cold prefill"), ("device_s", "resumed from device"),
                       ("host_s", "resumed from host"), ("disk_s", "resumed from disk")):
        ax.plot(contexts, [r[key] for r in results], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("cached conversation (tokens); each follow-up adds 32 new tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"time to first token by resume tier, size {results[0]['size']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.8b")
    ap.add_argument("--contexts", default="2048", help="comma-separated conversation lengths, in tokens")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="draw time to first token against context length here (PNG)")
    args = ap.parse_args()
    results = [run(args.size, int(c)) for c in args.contexts.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU\n")
    print("\n\n".join(report(r) for r in results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results if len(results) > 1 else results[0], indent=2))
    if args.plot:
        plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
