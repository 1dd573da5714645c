"""Disk restore against a plain read of the same file, at a model size's state dims, without a model.

Writes one segment as the disk tier does at a conversation's end (the snapshot of a full state slot of
`--size`, `--kv-tokens` tokens of fp32 KV, fp32 logits), then alternates, `--repeats` times: drop the file's
page cache and restore it into a working slot (SegmentTier.load_snapshot: read, every check, copy), drop
it again and read the file plainly. With `--against REV`, the cairn/cache/disk (and cairn/cache/segments) packages
of that git revision (read with `git show` into a temporary package) write and restore their own segment in the
same loop, so before and after are measured side by side on one machine state. The restored slot and
logits are checked bit for bit against the written ones every time.

    python benchmarks/disk_restore_bench.py --size 0.8b --against 1dadf98 --repeats 21

tier_bench.py measures the same restore inside a running engine (and times to first token); this one
needs no prefill, so it can alternate many restores in seconds. Not a test: figures, not assertions.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cairn.bench.checkpoint import SIZES, hf_config
from cairn.cache.disk.namespace import ReadBuffer
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import StateSpec
from cairn.model.families import config_from_hf

DIGEST = "ab" * 32
REPO = Path(__file__).resolve().parents[1]


def size_spec(size: str) -> tuple[StateSpec, int, int]:
    """(state spec, KV bytes per token, vocabulary) of a named checkpoint size, from the config cairn parses."""
    with tempfile.TemporaryDirectory() as tmp:  # the config.json a checkpoint of this size has
        hf_config(size).save_pretrained(tmp)
        cfg = config_from_hf(json.loads((Path(tmp) / "config.json").read_text()))
    kv_token_bytes = 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * 4
    return cfg.state_spec(torch.float32), kv_token_bytes, cfg.vocab_size


def cache_packages(rev: str, into: Path) -> str:
    """Copy cairn/cache/disk and cairn/cache/segments (where that revision has it) of git revision `rev` into `into`
    as subpackages of a package of its own; returns its name."""
    name = "cache_" + rev.replace("-", "_").replace(".", "_")
    files = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", rev, "cairn/cache/disk/",
                            "cairn/cache/segments/"], capture_output=True, text=True, check=True).stdout.split()
    (into / name).mkdir(parents=True)
    (into / name / "__init__.py").write_text("")
    for f in files:
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{f}"], capture_output=True, text=True,
                             check=True).stdout
        sub = Path(f).parent.name  # disk or segments
        (into / name / sub).mkdir(exist_ok=True)
        (into / name / sub / Path(f).name).write_text(src.replace("cairn.cache.disk", f"{name}.disk")
                                                      .replace("cairn.cache.segments", f"{name}.segments"))
    sys.path.insert(0, str(into))
    return name


class Side:
    """One implementation's tier, the segment it wrote, and its file."""

    def __init__(self, label: str, package: str, pool: StatePool, slot: int, num_tokens: int, kv_bytes: int,
                 logits: torch.Tensor):
        """`package`: cairn.cache, or the package cache_packages made (the tier lived in disk/ before segments/)."""
        has_segments = importlib.util.find_spec(f"{package}.segments") is not None
        tier_mod = importlib.import_module(f"{package}.{'segments' if has_segments else 'disk'}.tier")
        store_mod = importlib.import_module(f"{package}.disk.store")
        self.label, self.root = label, tempfile.mkdtemp(prefix="cairn-restore-")
        store = store_mod.DiskStore(self.root, DIGEST, 1 << 34)
        extra = {"restore_buffer": ReadBuffer()} if package == "cairn.cache" else {}
        tier_class = getattr(tier_mod, "SegmentTier", None) or tier_mod.DiskTier  # DiskTier before segments/
        self.tier = tier_class(store, 16, **extra)
        tokens = tuple(range(1, 1 + num_tokens))
        kv = torch.randn(kv_bytes // 4)
        segment = tier_mod.Segment(
            key=tier_mod.segment_key(None, tokens), parent_key=None, start_position=0, tokens=tokens,
            kv_bytes=tier_mod._to_bytes(kv), kv_meta=tier_mod._meta(kv), logits_bytes=tier_mod._to_bytes(logits),
            logits_meta=tier_mod._meta(logits), **tier_mod.snapshot_fields(pool.read_slot(slot)))
        assert store.put(segment)
        self.key = segment.key
        self.path = next(Path(self.root).glob(f"*/{segment.key.hex()}.seg"))


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def restore_once(side: Side, pool: StatePool, slot: int, expected: dict, logits: torch.Tensor) -> tuple[float, float]:
    """(wall, CPU) seconds of one restore of side's segment into pool[slot] (zeroed first), checked bit for bit.
    CPU time is the whole process's, so a checksum thread counts too."""
    for t in pool.read_slot(slot).values():
        t.zero_()
    drop_page_cache(side.path)
    start, cpu = time.perf_counter(), time.process_time()
    got = side.tier.load_snapshot(side.key, pool, slot)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert torch.equal(got, logits) and all(torch.equal(v, pool.read_slot(slot)[k]) for k, v in expected.items())
    return seconds, cpu


def plain_read(path: Path) -> tuple[float, float]:
    drop_page_cache(path)
    start, cpu = time.perf_counter(), time.process_time()
    path.read_bytes()
    return time.perf_counter() - start, time.process_time() - cpu


def run(args) -> dict[str, dict[str, list[float]]]:
    spec, kv_token_bytes, vocab = size_spec(args.size)
    pool = StatePool(spec, 2)
    src, dst = pool.alloc(), pool.alloc()
    for t in pool.read_slot(src).values():
        t.normal_()
    expected, logits = {k: v.clone() for k, v in pool.read_slot(src).items()}, torch.randn(vocab)
    sizes = (args.kv_tokens, kv_token_bytes * args.kv_tokens)
    sides = [Side("after", "cairn.cache", pool, src, *sizes, logits)]
    if args.against:
        package = cache_packages(args.against, Path(tempfile.mkdtemp(prefix="cairn-before-")))
        sides.insert(0, Side(f"before ({args.against})", package, pool, src, *sizes, logits))
    times: dict[str, dict[str, list]] = {s.label: {"restore": [], "plain": []} for s in sides}
    for _ in range(args.repeats):
        for side in sides:
            times[side.label]["restore"].append(restore_once(side, pool, dst, expected, logits))
            times[side.label]["plain"].append(plain_read(side.path))
    return {"file_bytes": sides[-1].path.stat().st_size, "times": times}


def report(r: dict, args) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [f"size {args.size} state dims, {args.kv_tokens} tokens of KV, file {r['file_bytes'] / 2**20:.2f} MiB; "
             f"median of {args.repeats} alternated runs, page cache dropped before each; torch "
             f"{torch.__version__}, {torch.get_num_threads()} threads, {cpu}", "",
             "| code | restore (median; range) | plain read | restore speed vs plain | restore CPU | plain read CPU |",
             "|---|---:|---:|---:|---:|---:|"]
    medians = {}
    for label, t in r["times"].items():
        walls = [wall for wall, _ in t["restore"]]
        restore, plain = statistics.median(walls), statistics.median(wall for wall, _ in t["plain"])
        cpu, plain_cpu = (statistics.median(c for _, c in t[k]) for k in ("restore", "plain"))
        medians[label] = restore
        lines.append(f"| {label} | {restore * 1e3:.2f} ms ({min(walls) * 1e3:.2f}-{max(walls) * 1e3:.2f}) | "
                     f"{plain * 1e3:.2f} ms | {100 * plain / restore:.0f}% | {cpu * 1e3:.2f} ms | "
                     f"{plain_cpu * 1e3:.2f} ms |")
    if len(medians) == 2:
        before, after = medians.values()
        lines += ["", f"after / before restore time: {after / before:.2f} ({before / after:.1f}x faster)"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.8b", choices=sorted(SIZES))
    ap.add_argument("--kv-tokens", type=int, default=32,
                    help="tokens of KV in the segment (32: the 20.1 MiB file tier_bench restores at 0.8b)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--against", default=None, help="a git revision whose disk tier restores side by side")
    args = ap.parse_args()
    print(report(run(args), args))


if __name__ == "__main__":
    main()
