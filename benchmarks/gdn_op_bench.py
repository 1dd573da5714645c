"""The fused Gated DeltaNet decode op alone (cairn/ops/cpu_gdn.py): this checkout's against another's, alternating.

One decode step's 18 GDN layers of the 0.8B shape (16 key / value heads of 128, a 4-tap conv), each layer with its
own states, `--batches` sequences. Each repeat times, per op: the 18 calls with the states just used (warm: the
1.2 MB per sequence and layer stay in the L2 / L3 caches) and the 18 calls after reading `--flush-mib` of other
memory (cold: the states come from memory, as in a decode step, whose weights stream through the caches between
two GDN layers); and, cold, `mul_` over the same recurrent states (one read and one write of each, at the memory's
speed: the floor for an op that reads and writes them once). The other op is any cpu_gdn.py, e.g. main's:

    git show main:cairn/ops/cpu_gdn.py > /tmp/cpu_gdn_main.py
    PYTHONPATH=. python benchmarks/gdn_op_bench.py --baseline /tmp/cpu_gdn_main.py --batches 1,16 --threads 1,2

The two ops' outputs and states are compared first (same inputs): printed as bit for bit or the largest difference.
A benchmark: asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.gemv_step_bench import module_or_file
from cairn.ops import cpu_gdn

K_HEADS, V_HEADS, DK, DV, KERNEL, LAYERS = 16, 16, 128, 128, 4, 18


def load_op(path: str | None):
    op = module_or_file(cpu_gdn, path).load()
    if not callable(op):
        raise SystemExit(f"the op does not load: {op}")
    return op


def layer_inputs(batch: int, gen: torch.Generator) -> list[torch.Tensor]:
    """One layer's op arguments: mixed, z, b, a (views of one in_proj output), conv and recurrent states, conv weight,
    A_log, dt_bias, norm weight."""
    conv_dim = 2 * K_HEADS * DK + V_HEADS * DV

    def bf(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    projected = bf(batch, conv_dim + V_HEADS * DV + 2 * V_HEADS)
    mixed, z, b, a = projected.split([conv_dim, V_HEADS * DV, V_HEADS, V_HEADS], dim=-1)
    return [mixed, z, b, a, bf(batch, conv_dim, KERNEL - 1), torch.randn(batch, V_HEADS, DK, DV, generator=gen) * 0.01,
            bf(conv_dim, KERNEL), bf(V_HEADS), bf(V_HEADS), bf(DV)]


def run(op, layers) -> None:
    for mixed, z, b, a, conv, rec, weight, a_log, dt_bias, norm in layers:
        op(mixed, z, b, a, conv, rec, weight, a_log, dt_bias, norm, K_HEADS, 1e-6)


def compare(ops: dict, batch: int) -> str:
    """Both ops on the same inputs and state copies: bit for bit, or the largest differences."""
    layer = layer_inputs(batch, torch.Generator().manual_seed(batch))
    got = []
    for op in ops.values():
        conv, rec = layer[4].clone(), layer[5].clone()
        got.append((op(*layer[:4], conv, rec, *layer[6:], K_HEADS, 1e-6), conv, rec))
    (out_a, conv_a, rec_a), (out_b, conv_b, rec_b) = got
    if torch.equal(out_a, out_b) and torch.equal(conv_a, conv_b) and torch.equal(rec_a, rec_b):
        return "bit for bit"
    return (f"output differs by up to {(out_a.float() - out_b.float()).abs().max().item():.3g}, recurrent state by "
            f"{(rec_a - rec_b).abs().max().item():.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="another cpu_gdn.py to time beside this checkout's op")
    ap.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--threads", default="2", type=lambda s: [int(t) for t in s.split(",")])
    ap.add_argument("--repeats", type=int, default=15, help="alternating rounds per point (best and median kept)")
    ap.add_argument("--flush-mib", type=int, default=512)
    args = ap.parse_args()
    ops = {"this": load_op(None)}
    if args.baseline:
        ops = {"baseline": load_op(args.baseline), **ops}
    flush = torch.ones(args.flush_mib * 2**18)
    print(f"CPU threads {args.threads}; {LAYERS} layers, {K_HEADS} heads of {DK} x {DV}, conv {KERNEL} taps")
    print("| threads | batch | op | warm ms (best / median) | cold ms (best / median) | state floor ms "
          "| cold / floor |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batches:
            if len(ops) == 2:
                print(f"<!-- batch {batch}: baseline against this: {compare(ops, batch)} -->")
            layers = [layer_inputs(batch, torch.Generator().manual_seed(i)) for i in range(LAYERS)]
            times = {(name, kind): [] for name in [*ops, "floor"] for kind in ("warm", "cold")}
            for _ in range(args.repeats):
                for name, op in ops.items():
                    run(op, layers)
                    t0 = time.perf_counter()
                    run(op, layers)
                    times[(name, "warm")].append(time.perf_counter() - t0)
                    flush.sum()
                    t0 = time.perf_counter()
                    run(op, layers)
                    times[(name, "cold")].append(time.perf_counter() - t0)
                flush.sum()
                t0 = time.perf_counter()
                for layer in layers:
                    layer[5].mul_(1.0)
                times[("floor", "cold")].append(time.perf_counter() - t0)
            floor = min(times[("floor", "cold")])
            for name in ops:
                warm, cold = times[(name, "warm")], times[(name, "cold")]
                print(f"| {threads} | {batch} | {name} | {1e3 * min(warm):.3f} / {1e3 * statistics.median(warm):.3f} | "
                      f"{1e3 * min(cold):.3f} / {1e3 * statistics.median(cold):.3f} | {1e3 * floor:.3f} | "
                      f"{min(cold) / floor:.2f}x |")


if __name__ == "__main__":
    main()
