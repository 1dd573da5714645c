"""Where one decode step's time goes: torch.profiler over engine steps, with a named range per piece.

The model is instrumented from outside (forward hooks and wrapped kernels; nothing in cairn changes),
then `--steps` decode steps of `--batch` greedy requests run under the profiler. Each range's CPU
time is summed and the step is split into exclusive parts:

    linear (GDN / attention / MLP)   the weight-reading matmuls of the decoder layers
    lm_head                          the output projection (rows needed only)
    norms                            RMSNorms (layer, q/k) with the residual add before each layer norm
                                     (one op, cairn/ops/cpu_norm.py), and the gated RMSNorm of GDN
    gdn conv update / recurrent step the two recurrent kernels of a decode step
    gdn rest                         its gating (beta, g), splits and copies into the state pool
    attention decode                 the paged decode kernel (bf16: cpu_attention's op; else page gather + SDPA)
    attention rest                   q/k rotary, KV writes into the pool, the output gate
    mlp rest                         silu(gate) * up
    model rest                       embedding, the final row pick
    runner build / sample / engine   the ForwardBatch(es), the sampler, scheduler and bookkeeping

    PYTHONPATH=. python benchmarks/decode_profile.py --dtype bfloat16 --batch 1 --layout packed
    PYTHONPATH=. python benchmarks/decode_profile.py --layout packed --threads 1 --clock cpu --batch 16
    PYTHONPATH=. python benchmarks/decode_profile.py --norm-side-by-side 3     # the fused norm against the reference
    PYTHONPATH=. python benchmarks/decode_profile.py --norm-side-by-side 3 --swap norm_rotary_write --count-ops
    PYTHONPATH=. python benchmarks/decode_profile.py --size 0.8b-skeleton --plan-side-by-side 7 --no-breakdown

The unprofiled step time is the engine's own (a pure decode step through the decode plan where it binds,
cairn/model/decode_plan.py); `--plan-side-by-side` times it against the same steps through the modules; the
breakdown, whose ranges are the modules', runs on the modules (the plan off).

The profiler adds a few microseconds per op, which inflates the many small ops against the matmuls;
the step time printed first is measured without it. On a shared machine the profiler's ranges hold
other processes' time slices too: `--clock cpu --threads 1` sums this process's CPU time per range
instead. A benchmark, not a test: asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

from benchmarks.engine_throughput import cairn_engine, prompt
from cairn.bench.checkpoint import make_checkpoint

KERNEL_RANGES = {"causal_conv1d_update": "gdn.conv_update", "recurrent_gated_delta_rule": "gdn.recurrent_step",
                 "paged_decode_attention": "attention.decode"}


class Ranges:
    """Inclusive time per range name, and the open ranges (to tell a norm inside a mixer from a layer norm).

    clock None: torch.profiler ranges (record_function), read back from the profiler's events;
    else each range is timed with `clock` (time.process_time: CPU seconds, what a shared machine
    leaves least distorted) into `totals`, in microseconds like the profiler's."""

    def __init__(self, clock=None):
        self.clock, self.totals, self.open = clock, {}, []

    def wrap(self, fn, name: str):
        if self.clock is None:
            def ranged(*args, **kwargs):
                with record_function(name):
                    return fn(*args, **kwargs)
            return ranged

        def timed(*args, **kwargs):
            if name == "norm":
                mixer = next((r for r in reversed(self.open) if r in MIXERS), None)
                key = f"norm.in.{mixer}" if mixer else None
            self.open.append(name)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = 1e6 * (self.clock() - t0)
                self.open.pop()
                self.totals[name] = self.totals.get(name, 0.0) + elapsed
                if name == "norm" and key:
                    self.totals[key] = self.totals.get(key, 0.0) + elapsed
        return timed


MIXERS = ("gdn.layer", "attention.layer")


def instrument(engine, ranges: Ranges) -> None:
    """Name the pieces of a decode step (see the module docstring)."""
    from cairn.layers.attention import GatedAttention
    from cairn.layers.gated_deltanet import GatedDeltaNet
    from cairn.layers.mlp import SwiGLU
    from cairn.layers.norm import GatedRMSNorm, RMSNorm

    model = engine.model
    model.plan_decode = False  # the ranges are the modules': a decode plan would call past them
    for owner, kind in ((GatedDeltaNet, "gdn"), (GatedAttention, "attention"), (SwiGLU, "mlp")):
        for module in model.modules():
            if isinstance(module, owner):
                for child in module.children():
                    if not isinstance(child, (RMSNorm, GatedRMSNorm)):
                        child.forward = ranges.wrap(child.forward, f"linear.{kind}")
                module.forward = ranges.wrap(module.forward, f"{kind}.layer")
    for module in model.modules():
        if isinstance(module, GatedRMSNorm):
            module.forward = ranges.wrap(module.forward, "norm")
        if isinstance(module, RMSNorm):  # no forward: the residual add and the norm run in add_and_norm
            module.add_and_norm = ranges.wrap(module.add_and_norm, "norm")
    model.lm_head.forward = ranges.wrap(model.lm_head.forward, "lm_head")
    model.forward = ranges.wrap(model.forward, "model")
    model.kernels = dataclasses.replace(model.kernels, **{
        field: ranges.wrap(getattr(model.kernels, field), name) for field, name in KERNEL_RANGES.items()})
    engine.runner._build = ranges.wrap(engine.runner._build, "runner.build")
    engine.step = ranges.wrap(engine.step, "engine.step")
    import cairn.engine.engine
    cairn.engine.engine.sample_isolated = ranges.wrap(cairn.engine.engine.sample_isolated, "sample")


def start_decoding(engine, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Admit `batch` greedy requests and step until every one has its first token."""
    from cairn.request.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(prompt(prompt_len, seed=i), params) for i in range(batch)}
    started: set[str] = set()
    while not started >= ids:
        started |= {o.request_id for o in engine.step()}


def step_s(engine, batch: int, steps: int, prompt_len: int, clock=time.perf_counter) -> float:
    """Seconds per decode step on `clock` (wall by default), unprofiled, once the batch is decoding."""
    start_decoding(engine, batch, prompt_len, steps + 2)
    t0 = clock()
    for _ in range(steps):
        engine.step()
    elapsed = (clock() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    return elapsed


REFERENCES = {"add_rms_norm": "cairn.ops.norm:add_rms_norm",
              "norm_rotary_write": "cairn.ops.attention:norm_rotary_write",
              "gdn_decode_op": "cairn.ops.gdn:no_decode_op",
              "silu_mul": "cairn.ops.activation:silu_mul"}


def side_by_side(engine, batch: int, steps: int, prompt_len: int, repeats: int,
                 variants: dict[str, Callable[[], None]], clock=time.perf_counter) -> dict[str, list[float]]:
    """ms per decode step on `clock`, unprofiled, for each variant (its function sets the engine up for it),
    alternating `repeats` times on the same engine."""
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, set_up in variants.items():
            set_up()
            runs[name].append(1e3 * step_s(engine, batch, steps, prompt_len, clock))
    return runs


def norm_side_by_side(engine, batch: int, steps: int, prompt_len: int, repeats: int, fields: list[str],
                      clock=time.perf_counter) -> dict[str, list[float]]:
    """side_by_side of the engine's kernels ("fused") and the same with `fields` swapped for their references
    (REFERENCES), both on the modules (no decode plan, which binds only the fused ops: it would be timed too)."""
    import importlib

    model, fused = engine.model, engine.model.kernels
    swapped = {}
    for field in fields:
        module, name = REFERENCES[field].split(":")
        swapped[field] = getattr(importlib.import_module(module), name)
    reference, planned = dataclasses.replace(fused, **swapped), model.plan_decode
    model.plan_decode = False
    runs = side_by_side(engine, batch, steps, prompt_len, repeats, {
        "fused": lambda: setattr(model, "kernels", fused), "reference": lambda: setattr(model, "kernels", reference)},
        clock)
    model.kernels, model.plan_decode = fused, planned
    return runs


def plan_side_by_side(engine, batch: int, steps: int, prompt_len: int, repeats: int,
                      clock=time.perf_counter) -> dict[str, list[float]]:
    """side_by_side of pure decode steps through the decode plan ("plan") and through the modules ("modules")."""
    model, planned = engine.model, engine.model.plan_decode
    runs = side_by_side(engine, batch, steps, prompt_len, repeats, {
        "plan": lambda: setattr(model, "plan_decode", True), "modules": lambda: setattr(model, "plan_decode", False)},
        clock)
    model.plan_decode = planned
    return runs


def print_side_by_side(runs: dict[str, list[float]], label: str) -> None:
    """Each variant's runs, best and median, and the second's over the first's."""
    best = {name: min(ms) for name, ms in runs.items()}
    median = {name: statistics.median(ms) for name, ms in runs.items()}
    first, second = runs
    print(" | ".join(f"{name}: {' '.join(f'{m:.1f}' for m in ms)} ms/step (best {best[name]:.2f}, median "
                     f"{median[name]:.2f})" for name, ms in runs.items())
          + f" | {second} ({label}) / {first}: best {best[second] / best[first]:.3f}x, median "
          f"{median[second] / median[first]:.3f}x")


def breakdown(totals: dict[str, float], steps: int) -> list[tuple[str, float]]:
    """Exclusive ms per step of each part, from the ranges' inclusive CPU times (us)."""
    t = {name: totals.get(name, 0.0) / steps / 1e3 for name in (
        "engine.step", "model", "runner.build", "sample", "lm_head", "norm", "linear.gdn", "linear.attention",
        "linear.mlp", "gdn.layer", "attention.layer", "mlp.layer", *KERNEL_RANGES.values())}
    norm_gdn, norm_attention = (totals.get(f"norm.in.{k}.layer", 0.0) / steps / 1e3 for k in ("gdn", "attention"))
    parts = [
        ("linear (GDN)", t["linear.gdn"]), ("linear (attention)", t["linear.attention"]),
        ("linear (MLP)", t["linear.mlp"]), ("lm_head", t["lm_head"]), ("norms", t["norm"]),
        ("gdn conv update", t["gdn.conv_update"]), ("gdn recurrent step", t["gdn.recurrent_step"]),
        ("gdn rest", t["gdn.layer"] - t["linear.gdn"] - t["gdn.conv_update"] - t["gdn.recurrent_step"] - norm_gdn),
        ("attention decode", t["attention.decode"]),
        ("attention rest", t["attention.layer"] - t["linear.attention"] - t["attention.decode"] - norm_attention),
        ("mlp rest", t["mlp.layer"] - t["linear.mlp"]),
    ]
    layer_norms = t["norm"] - norm_gdn - norm_attention
    inside = t["gdn.layer"] + t["attention.layer"] + t["mlp.layer"] + t["lm_head"] + layer_norms
    parts.append(("model rest", t["model"] - inside))
    parts += [("runner build", t["runner.build"]), ("sample", t["sample"]),
              ("engine rest", t["engine.step"] - t["model"] - t["runner.build"] - t["sample"])]
    return parts


def measure_steps(engine, ranges: Ranges, batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    """Inclusive us of every named range over `steps` decode steps (the profiler's, or `ranges`' clock)."""
    from torch.profiler import ProfilerActivity, profile

    start_decoding(engine, batch, prompt_len, steps + 2)
    if ranges.clock is not None:
        ranges.totals.clear()
        for _ in range(steps):
            engine.step()
        totals = dict(ranges.totals)
    else:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
        totals = {}
        for event in prof.events():
            mixer = _mixer_of(event) if event.name == "norm" else None
            for name in [event.name] + ([f"norm.in.{mixer}"] if mixer else []):
                totals[name] = totals.get(name, 0.0) + event.cpu_time_total
    while engine.has_unfinished():
        engine.step()
    return totals


def count_ops(engine, batch: int, steps: int, prompt_len: int) -> dict[str, int]:
    """Top-level ATen calls per decode step, by name (an op called inside another op, or inside one of
    cairn's C++ ops, is not counted): the Python / dispatcher overhead a step pays besides its kernels."""
    from torch.profiler import ProfilerActivity, profile

    start_decoding(engine, batch, prompt_len, steps + 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    counts: dict[str, int] = {}
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and parent is None:
            counts[event.name] = counts.get(event.name, 0) + 1
    return {name: n / steps for name, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def _mixer_of(event) -> str | None:
    """The mixer range ("gdn.layer" / "attention.layer") an event runs inside, if any."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in ("gdn.layer", "attention.layer"):
            return parent.name
        parent = parent.cpu_parent
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layout", default="auto", help="auto, plain, packed or int8 (quantized)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--clock", choices=("profiler", "cpu"), default="profiler",
                    help="profiler: torch.profiler ranges; cpu: process CPU time per range, no profiler (less "
                    "distorted by other processes and by the profiler's per-op cost; one thread makes it exact)")
    ap.add_argument("--norm-side-by-side", type=int, default=0, metavar="REPEATS",
                    help="first time decode steps unprofiled with the engine's kernels and with --swap's fields on "
                    "their references, alternating REPEATS times (best of each, and their ratio; on --clock's clock)")
    ap.add_argument("--swap", default="add_rms_norm",
                    help="Kernels fields that --norm-side-by-side puts on the reference, comma-separated: "
                    + ", ".join(REFERENCES))
    ap.add_argument("--plan-side-by-side", type=int, default=0, metavar="REPEATS",
                    help="first time decode steps unprofiled through the decode plan and through the modules, "
                    "alternating REPEATS times (best of each, and their ratio; on --clock's clock)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="stop after the unprofiled step time and the side-by-sides / --count-ops")
    ap.add_argument("--count-ops", action="store_true",
                    help="also count top-level ATen calls per decode step, by name (torch.profiler)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = {"quantization": "int8"} if args.layout == "int8" else {"weight_layout": args.layout}
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint(args.size, Path(d))
        engine = cairn_engine(Path(d), dtype=args.dtype, max_num_seqs=max(args.batch, 1), **options)
        step_s(engine, args.batch, 2, args.prompt_len)  # warm-up
        wall_ms = 1e3 * step_s(engine, args.batch, args.steps, args.prompt_len)
        print(f"{args.size} {args.dtype} {engine.weight_layout} batch {args.batch}, {args.threads} threads: "
              f"{wall_ms:.1f} ms per step unprofiled")
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        if args.norm_side_by_side:
            print_side_by_side(norm_side_by_side(engine, args.batch, args.steps, args.prompt_len,
                                                 args.norm_side_by_side, args.swap.split(","), clock), args.swap)
        if args.plan_side_by_side:
            print_side_by_side(plan_side_by_side(engine, args.batch, args.steps, args.prompt_len,
                                                 args.plan_side_by_side, clock), "no decode plan")
        if args.count_ops:
            counts = count_ops(engine, args.batch, args.steps, args.prompt_len)
            print(f"top-level ATen calls per decode step: {sum(counts.values()):.0f}; "
                  + ", ".join(f"{name[6:]} {n:g}" for name, n in counts.items()))
        if not args.breakdown:
            return
        ranges = Ranges(time.process_time if args.clock == "cpu" else None)
        instrument(engine, ranges)
        totals = measure_steps(engine, ranges, args.batch, args.steps, args.prompt_len)
    parts = breakdown(totals, args.steps)
    total = sum(ms for _, ms in parts)
    print(f"{total:.1f} ms per step measured ({args.clock})")
    print("| part | ms per step | share |\n|---|---:|---:|")
    for name, ms in parts:
        print(f"| {name} | {ms:.2f} | {100 * ms / total:.1f}% |")


if __name__ == "__main__":
    main()
