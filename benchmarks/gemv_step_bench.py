"""One decode step's weights through two gemv kernels, alternating: this checkout's and another's.

The weights are the 0.8B model's linears in the order one decode step runs them (random bf16, one
tensor per linear, 1063 MB, so nothing stays in the 300 MiB L3 between steps); each repeat times a
torch `sum` over 2 GiB, cairn's own streaming read, then a whole step of gemv calls with each kernel.
The other kernel is any cpu_gemv.py, e.g. main's:

    git show main:cairn/ops/cpu_gemv.py > /tmp/cpu_gemv_main.py
    PYTHONPATH=. python benchmarks/gemv_step_bench.py --baseline /tmp/cpu_gemv_main.py --rows 1,2

The outputs of the two are compared on the first linears: on the same instruction path with the same
summation order they are equal bit for bit and the comparison is of speed alone. Across paths (this
checkout's AMX path against a baseline's AVX512-BF16 one, or `--baseline-isa` forcing this checkout's
kernel onto another path), or where a path's order changed (the AVX2 path's, which sums 16-weight chunks
since cairn_cpu_gemv5), they agree within bf16 rounding, and the largest difference is printed. `--linear` adds F.linear
(oneDNN) to the alternation, the layouts' choice above the kernel's rows:

    PYTHONPATH=. python benchmarks/gemv_step_bench.py --baseline-isa avx512_bf16 --rows 1,2,4,16 --linear

A benchmark: asserts nothing else.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from benchmarks.gemv_bench import SHAPES_0_8B
from cairn.ops import cpu_gemv, cpu_isa


def step_order() -> list[tuple[int, int]]:
    """(out, in) of every linear of one 0.8B decode step, in order: 3 GDN layers then 1 attention, x6."""
    shape = {name: (out_f, in_f) for name, out_f, in_f, _ in SHAPES_0_8B}
    order = []
    for layer in range(24):
        if layer % 4 != 3:
            order += [shape["gdn.in_proj"], shape["gdn.out_proj"]]
        else:
            order += [shape["attn.q_proj"], shape["attn.k_proj/v_proj"], shape["attn.k_proj/v_proj"],
                      shape["attn.o_proj"]]
        order += [shape["mlp.gate_up"], shape["mlp.down"]]
    return order + [shape["lm_head"]]


def module_or_file(module, path: str | None):
    """`module` itself, or (path given) another version of it loaded from that file as "baseline_<its name>": the
    op benchmarks time this checkout's op beside another's (its own NAME, so its own build)."""
    if not path:
        return module
    spec = importlib.util.spec_from_file_location("baseline_" + module.__name__.rsplit(".", 1)[-1], path)
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other
    spec.loader.exec_module(other)
    return other


def baseline_kernel(path: str | None, isa: str | None) -> cpu_gemv.GemvKernel:
    module = module_or_file(cpu_gemv, path)
    flags = cpu_isa.cpu_flags()
    kernel = module.load(flags, isa) if isa else module.load(flags)
    if isinstance(kernel, str):
        raise SystemExit(f"the baseline kernel does not load: {kernel}")
    return kernel


def runners(kernels: dict[str, object], weights: list[torch.Tensor], tiles: list[tuple[int, int]]) -> dict:
    """name -> (call(x, weight, n), the weights it takes): a kernel on a packed path (this checkout's AVX2
    path) multiplies the packed weights, one copy shared by its tile variants (`--tiles`); the others the
    weights as loaded."""
    out, packed = {}, None
    for name, kernel in kernels.items():
        if isinstance(kernel, cpu_gemv.GemvKernel) and kernel.packs:
            packed = packed or [cpu_gemv.pack(w) for w in weights]
            out[name] = (lambda x, p, n, k=kernel: k.packed(x, p, n), packed)
            for tile in tiles:
                out[f"{name} {tile[0]}x{tile[1]}"] = (lambda x, p, n, k=kernel, t=tile: k.packed(x, p, n, t), packed)
        else:
            out[name] = (lambda x, w, n, k=kernel: k(x, w), weights)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="path of the other cpu_gemv.py (default: this one)")
    ap.add_argument("--baseline-isa", default=None, help="force the baseline kernel onto this path (avx512_bf16, avx2)")
    ap.add_argument("--linear", action="store_true", help="also time F.linear over the same weights")
    ap.add_argument("--rows", default="1,2", type=lambda s: [int(r) for r in s.split(",")])
    ap.add_argument("--tiles", default="",
                    type=lambda s: [tuple(int(v) for v in t.split("x")) for t in s.split(",") if t],
                    help="also time this checkout's packed path forced onto these tiles (blocks x rows, e.g. 1x6,2x3)")
    ap.add_argument("--repeats", type=int, default=7, help="alternating steps per kernel (the median is reported)")
    args = ap.parse_args()
    base = baseline_kernel(args.baseline, args.baseline_isa)
    kernels = {"baseline": base, "this": cpu_gemv.load(cpu_isa.cpu_flags())}
    if isinstance(kernels["this"], str):
        raise SystemExit(f"this checkout's kernel does not load: {kernels['this']}")
    print(f"baseline: {args.baseline or 'this checkout'} on {base.isa}; this: {kernels['this'].isa}"
          + (" (packed weights)" if kernels["this"].packs else ""))
    if args.linear:
        kernels["F.linear"] = torch.nn.functional.linear
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out_f, in_f, generator=gen) * 0.02).bfloat16() for out_f, in_f in step_order()]
    step_bytes = sum(w.numel() * 2 for w in weights)
    calls = runners(kernels, weights, args.tiles)
    buf = torch.ones((2 << 30) // 4)
    print(f"{step_bytes / 1e6:.0f} MB of weights per step, {torch.get_num_threads()} threads")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {w.shape[1] for w in weights}}
        diff = 0.0
        for i, w in enumerate(weights[:8]):
            x, n = xs[w.shape[1]], w.shape[0]
            a = calls["baseline"][0](x, calls["baseline"][1][i], n)
            b = calls["this"][0](x, calls["this"][1][i], n)
            diff = max(diff, ((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-3)).max().item())
        if diff:
            print(f"rows {rows}: the two paths' outputs differ by up to {diff:.2g} relative (bf16 rounding)")
        gbs: dict[str, list[float]] = {"sum": [], "own read": [], **{name: [] for name in calls}}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            buf.sum()
            gbs["sum"].append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            kernels["this"].stream_read(buf)
            gbs["own read"].append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
            for name, (call, ws) in calls.items():
                t0 = time.perf_counter()
                for w, orig in zip(ws, weights, strict=True):
                    call(xs[orig.shape[1]], w, orig.shape[0])
                gbs[name].append(step_bytes / (time.perf_counter() - t0) / 1e9)
        med = {name: statistics.median(v) for name, v in gbs.items()}
        print(f"rows {rows}: " + ", ".join(f"{name} {v:.1f} GB/s" for name, v in med.items())
              + f" (medians); this / baseline {med['this'] / med['baseline']:.2f}x, this / sum "
              f"{100 * med['this'] / med['sum']:.0f}%"
              + (f", this / F.linear {med['this'] / med['F.linear']:.2f}x" if "F.linear" in med else ""), flush=True)

if __name__ == "__main__":
    main()
