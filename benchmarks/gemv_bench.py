"""The decode matmul alone: how fast each way of computing y = x W^T streams a bf16 weight at a few rows.

For every linear shape of the 0.8B model (Qwen3.5-0.8B dimensions, vocabulary cut to 32k) and each
batch size, the weight is read from memory, not from a cache: before every timed call a 512 MiB buffer
is read (untimed), which evicts the L3 (300 MiB here) and the weight with it. The variants:

    plain         F.linear on the [out, in] weight as loaded
    packed        oneDNN's blocked weight, torch.ops.mkldnn._linear_pointwise (--weight-layout packed)
    gemv          cairn's C++ gemv (cairn/ops/cpu_gemv.py), its best path here (AVX512-BF16)
    gemv-avx2     the same kernel forced onto its AVX2 fallback path
    compile       torch.compile(inductor, freezing) of a module holding the weight, default mode
    compile-max   the same with mode="max-autotune" and the cpp GEMM template forced
                  (TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=CPP: its AMX / AVX512-BF16 micro-kernels)

and the memory bandwidth of the same run: a plain `sum` over a 2 GiB fp32 tensor, best of three, on the
same clock as the calls. A
row's GB/s is its weight bytes over the median call time; "step" weighs every shape by how often a
decode step of the 0.8B model runs it (the bytes of one step over the time of its calls).

    PYTHONPATH=. python benchmarks/gemv_bench.py --out benchmarks/out/gemv_bench.json
    PYTHONPATH=. python benchmarks/gemv_bench.py --variants plain,gemv --batches 1 --repeats 5
    PYTHONPATH=. python benchmarks/gemv_bench.py --threads 1 --clock cpu     # on a shared machine

Variants run alternating within each repeat (the CPU may be shared). A benchmark: asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.decode_bench import cpu_info

# (name, out_features, in_features, linears of this shape in one decode step of the 0.8b model)
SHAPES_0_8B = [
    ("gdn.in_proj", 8224, 1024, 18), ("gdn.out_proj", 1024, 2048, 18),
    ("attn.q_proj", 4096, 1024, 6), ("attn.k_proj/v_proj", 512, 1024, 12), ("attn.o_proj", 1024, 2048, 6),
    ("mlp.gate_up", 7168, 1024, 24), ("mlp.down", 1024, 3584, 24), ("lm_head", 32768, 1024, 1),
]
FLUSH_BYTES = 512 << 20


class Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def compiled(weight: torch.Tensor, x: torch.Tensor, mode: str | None) -> tuple[object, float]:
    """torch.compile of a one-linear module with the weight frozen in (the way inductor packs weights)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    if mode == "max-autotune":
        os.environ["TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS"] = "CPP"
    torch._dynamo.reset()
    fn = torch.compile(Linear(weight).eval(), mode=mode)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(x)
    return fn, time.perf_counter() - t0


def make_variants(names: list[str], weight: torch.Tensor, x: torch.Tensor) -> tuple[dict, dict]:
    """name -> a callable of x, and name -> its set-up seconds (compiling, building, packing)."""
    from cairn.model.layout import PackedLinear
    from cairn.ops import cpu_gemv, cpu_isa

    fns, setup = {}, {}
    for name in names:
        t0 = time.perf_counter()
        if name == "plain":
            fns[name] = lambda x, w=weight: F.linear(x, w)
        elif name == "packed":
            fns[name] = PackedLinear(weight)
        elif name in ("gemv", "gemv-avx2"):
            kernel = cpu_gemv.load(cpu_isa.cpu_flags(), "avx2" if name == "gemv-avx2" else None)
            if isinstance(kernel, str):
                print(f"  {name}: skipped ({kernel})")
                continue
            fns[name] = lambda x, w=weight, k=kernel: k(x, w)
        elif name in ("compile", "compile-max"):
            fns[name], _ = compiled(weight, x, "max-autotune" if name == "compile-max" else None)
        setup[name] = time.perf_counter() - t0
    return fns, setup


def time_calls(fns: dict, x: torch.Tensor, flush: torch.Tensor, repeats: int, clock) -> dict[str, list[float]]:
    """Seconds of each variant's calls on `clock`, each after the caches were flushed, variants alternating."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn(x)  # warm-up
        for _ in range(repeats):
            for name, fn in fns.items():
                flush.sum()
                t0 = clock()
                fn(x)
                times[name].append(clock() - t0)
    return times


def read_gbs(buf: torch.Tensor, clock, repeats: int = 3) -> float:
    """GB/s of a plain read of `buf` (a sum over it) on `clock`, best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        buf.sum()
        best = min(best, clock() - t0)
    return buf.numel() * buf.element_size() / best / 1e9


def run(args, clock) -> list[dict]:
    flush = torch.ones(FLUSH_BYTES // 4)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape, out_f, in_f, count in SHAPES_0_8B:
        weight = (torch.randn(out_f, in_f, generator=gen) * 0.02).bfloat16()
        for batch in args.batches:
            x = torch.randn(batch, in_f, generator=gen).bfloat16()
            fns, setup = make_variants(args.variants, weight, x)
            times = time_calls(fns, x, flush, args.repeats, clock)
            for name, t in times.items():
                median = statistics.median(t)
                rows.append({"shape": shape, "out": out_f, "in": in_f, "count": count, "batch": batch,
                             "variant": name, "median_s": median, "runs_s": t, "setup_s": setup[name],
                             "weight_bytes": weight.numel() * 2, "gbs": weight.numel() * 2 / median / 1e9})
            print(f"  {shape} [{out_f}x{in_f}] b{batch}: " + ", ".join(
                f"{r['variant']} {r['gbs']:.1f}" for r in rows[-len(times):]) + " GB/s", flush=True)
    return rows


def step_rows(rows: list[dict]) -> list[dict]:
    """Per variant and batch: one decode step's weight bytes over the time its calls take."""
    out = []
    for key in sorted({(r["variant"], r["batch"]) for r in rows}, key=lambda k: (k[1], k[0])):
        mine = [r for r in rows if (r["variant"], r["batch"]) == key]
        if len(mine) < len(SHAPES_0_8B):
            continue
        step_bytes = sum(r["weight_bytes"] * r["count"] for r in mine)
        step_s = sum(r["median_s"] * r["count"] for r in mine)
        out.append({"variant": key[0], "batch": key[1], "step_bytes": step_bytes, "step_s": step_s,
                    "gbs": step_bytes / step_s / 1e9, "setup_s": sum(r["setup_s"] for r in mine)})
    return out


def table(rows: list[dict], steps: list[dict], bandwidth: float, variants: list[str]) -> str:
    batches = sorted({r["batch"] for r in rows})
    head = "| shape | batch | " + " | ".join(variants) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(variants)]
    for shape, *_ in SHAPES_0_8B:
        for b in batches:
            got = {r["variant"]: r["gbs"] for r in rows if r["shape"] == shape and r["batch"] == b}
            lines.append(f"| {shape} | {b} | " + " | ".join(f"{got[v]:.1f}" if v in got else "-" for v in variants)
                         + " |")
    for b in batches:
        got = {s["variant"]: s["gbs"] for s in steps if s["batch"] == b}
        lines.append(f"| **step** (of {bandwidth:.1f} read) | {b} | " + " | ".join(
            f"**{got[v]:.1f} ({100 * got[v] / bandwidth:.0f}%)**" if v in got else "-" for v in variants) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="plain,packed,gemv,gemv-avx2,compile,compile-max",
                    type=lambda s: s.split(","))
    ap.add_argument("--batches", default="1,4,16", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per variant and point (the median is kept)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: elapsed time; cpu: this thread's CPU time (with --threads 1 on a shared machine, "
                    "where other processes' time slices would otherwise count)")
    ap.add_argument("--out", default=None, help="write the rows and the machine as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    bandwidth = read_gbs(torch.ones((2 << 30) // 4), clock)
    rows = run(args, clock)
    steps = step_rows(rows)
    machine = {"cpu": cpu_info(), "torch": torch.__version__, "threads": args.threads}
    print(f"\n{machine['cpu']['model']} ({', '.join(machine['cpu']['flags'])}), torch {torch.__version__}, "
          f"{args.threads} threads; GB/s of weights streamed (median call), memory read {bandwidth:.1f} GB/s\n")
    print(table(rows, steps, bandwidth, [v for v in args.variants if any(r["variant"] == v for r in rows)]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": machine, "memory_bandwidth_gbs": bandwidth,
                                              "args": vars(args), "rows": rows, "steps": steps}, indent=2))


if __name__ == "__main__":
    main()
