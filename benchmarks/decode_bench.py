"""Decode speed against the memory bandwidth, and against transformers on the same weights, in one run.

Per dtype and batch size: cairn's decode tokens/s (aggregate over the batch) for each weight layout
asked for (plain, packed, gemv: cairn's own bf16 gemv kernel on the best path the CPU has, gemv-unfused:
the same without the fused Gated DeltaNet decode op, gemv-sdpa: the same with decode attention on the reference
(SDPA over gathered pages) instead of cairn's paged op, gemv-avx512: the kernel forced onto its AVX512-BF16
dot products where `gemv` takes AMX tiles, gemv-rowmajor: every weight as loaded, which on the AVX2 path
is the row-major dot-product kernel `gemv` ran before its packed weights, int8: weight-only int8 on the layout
`auto` gives it, i.e. the int8 form of cairn's AVX2 kernel where the gemv layout takes that path, int8-aten: int8
on ATen's `_weight_int8pack_mm` everywhere; path-amx_bf16, path-avx512_bf16, path-avx2, path-none: the default
layout on that CPU instruction path, `--cpu-isa`, one row per path this CPU runs), the weight bytes one decode step
reads, the weight-read bandwidth that achieves (bytes x steps/s), the machine's memory bandwidth
measured in the same run (a plain `sum` over a large fp32 tensor, best of its runs), their ratio,
the same against cairn's own streaming read of that tensor (a loop of vector loads in the gemv
kernel's library, which reads faster than `sum` on some machines; "own read"), and transformers'
`generate` on the same weights in the same dtype. Batched steps are bound by arithmetic rather than by the
weight read, so each point also reports the CPU's measured matmul ceiling (a 1024^3 fp32 GEMM on operands that
stay in cache, best of its runs: torch's BLAS at about the FMA units' peak) and the share of it the step's
linears would use if they were all of the step ("of GEMM": 2 x batch x linear weights x steps/s over the
ceiling; the linears alone, taking less than the whole step, reach at least that). Models are built as in
engine_throughput.py (random weights, Qwen3.5-0.8B dimensions with the vocabulary cut to 32k).

    PYTHONPATH=. python benchmarks/decode_bench.py --out benchmarks/out/decode_bench.json
    PYTHONPATH=. python benchmarks/decode_bench.py --dtypes bfloat16 --batches 1 --layouts gemv,plain

Points are measured side by side: each repeat runs every variant and transformers once, alternating,
and the best of the repeats is kept (the CPU may be shared). A benchmark, not a test: asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_throughput import (
    cairn_decode_tok_s,
    cairn_engine,
    cairn_prefill_s,
    hf_decode_tok_s,
)
from cairn.bench.checkpoint import make_checkpoint


def cpu_info() -> dict:
    """CPU model and the flags that matter for matmuls, from /proc/cpuinfo (Linux)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            if key.strip() == "flags":
                flags = value.split()
                break
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
    return {"model": model, "flags": [f for f in wanted if f in flags], "all_flags": " ".join(flags)}


def best_seconds(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn()."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth_gbs(buf: torch.Tensor, repeats: int = 3) -> float:
    """Bytes/s of a plain read of `buf` (a sum over it), best of `repeats`, in GB/s."""
    return buf.numel() * buf.element_size() / best_seconds(buf.sum, repeats) / 1e9


def stream_read_gbs(buf: torch.Tensor, repeats: int = 3) -> float | None:
    """GB/s of cairn's own streaming read of `buf` (cpu_gemv's loop of vector loads), best of `repeats`;
    None where the kernel does not load. Reported beside `sum`, which reads slower on some machines."""
    from cairn.ops import cpu_gemv, cpu_isa

    kernel = cpu_gemv.load(cpu_isa.cpu_flags())
    if isinstance(kernel, str):
        return None
    return buf.numel() * buf.element_size() / best_seconds(lambda: kernel.stream_read(buf), repeats) / 1e9


def gemm_ceiling_gflops(repeats: int = 5, n: int = 1024) -> float:
    """GFLOP/s of an fp32 n x n x n matmul on operands that stay in cache (12 MiB), best of `repeats`: the
    arithmetic a batched decode step can at most do per second on this CPU."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def linear_weights(hf) -> int:
    """Multiply-adds per token of the model's linear layers (lm_head included), from the reference model."""
    return sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))


def variants(layouts: list[str]) -> dict[str, dict]:
    """Engine model options per layout name: plain / packed weight layouts, int8 weight-only quantization."""
    table = {"auto": {}, "plain": {"weight_layout": "plain"}, "packed": {"weight_layout": "packed"},
             "gemv": {"weight_layout": "gemv"}, "gemv-unfused": {"weight_layout": "gemv"},
             "gemv-avx512": {"weight_layout": "gemv"}, "gemv-rowmajor": {"weight_layout": "plain"},
             "gemv-sdpa": {"weight_layout": "gemv"},
             "int8": {"quantization": "int8"}, "int8-aten": {"quantization": "int8", "weight_layout": "plain"}}
    table |= {f"path-{path}": {"cpu_isa": path} for path in ("amx_bf16", "avx512_bf16", "avx2", "none")}
    return {name: table[name] for name in layouts}


def force_gemv_isa(model, isa: str) -> bool:
    """Put the gemv layout's linears on the kernel's `isa` path (with that path's rows, F.linear above):
    the AVX512-BF16 dot products beside the AMX tiles `auto` picks. False where the path does not load."""
    from cairn.model.layout import GemvLinear
    from cairn.ops import cpu_gemv, cpu_isa

    kernel = cpu_gemv.load(cpu_isa.cpu_flags(), isa)
    if isinstance(kernel, str):
        return False
    for module in model.modules():
        if isinstance(module, GemvLinear):
            module.kernel, module.direct_rows = kernel, kernel.direct_rows
    return True


def row_major_gemv(model) -> bool:
    """Put the plain layout's linears on the gemv kernel with every weight as loaded (`pack=False`): on the
    AVX2 path, the row-major dot-product kernel at every row count, the layout before the packed weights.
    False where the kernel does not load."""
    from cairn.model import layout
    from cairn.ops import cpu_gemv, cpu_isa

    kernel = cpu_gemv.load(cpu_isa.cpu_flags())
    if isinstance(kernel, str):
        return False
    layout._replace(model, lambda w, shared: layout.GemvLinear(w, kernel, pack=False))
    return True


def build_engines(path: Path, dtype: str, layouts: list[str], max_batch: int) -> dict:
    from cairn.model.layout import decode_weight_bytes
    from cairn.ops import attention, gdn

    engines = {}
    for name, options in variants(layouts).items():
        try:
            engine = cairn_engine(path, dtype=dtype, max_num_seqs=max_batch, **options)
        except ValueError as e:  # a layout this machine or dtype does not support
            print(f"  {dtype} {name}: skipped ({e})")
            continue
        if name == "gemv-unfused":  # the Gated DeltaNet decode on the reference kernels, not the fused op
            engine.model.kernels = dataclasses.replace(engine.model.kernels, gdn_decode_op=gdn.no_decode_op)
        if name == "gemv-sdpa":  # decode attention on the reference (SDPA over gathered pages), not cairn's op
            engine.model.kernels = dataclasses.replace(engine.model.kernels,
                                                       paged_decode_attention=attention.paged_decode_attention)
        if name == "gemv-rowmajor" and (dtype != "bfloat16" or not row_major_gemv(engine.model)):
            print(f"  {dtype} {name}: skipped (bf16 on a CPU the gemv kernel runs on only)")
            continue
        if name == "gemv-avx512" and not force_gemv_isa(engine.model, "avx512_bf16"):
            print(f"  {dtype} {name}: skipped (no AVX512-BF16 path here)")
            continue
        engines[name] = (engine, decode_weight_bytes(engine.model))
    return engines


def run_dtype(path: Path, hf, dtype: str, args, buf: torch.Tensor) -> list[dict]:
    macs = linear_weights(hf)
    engines = build_engines(path, dtype, args.layouts.split(","), max(args.batches))
    hf = hf.to(getattr(torch, dtype)) if args.hf else None
    for engine, _ in engines.values():  # warm-up: first calls pay page faults and oneDNN set-up
        cairn_decode_tok_s(engine, 1, 2, args.prompt_len)
    if hf is not None:
        hf_decode_tok_s(hf, 1, 2, args.prompt_len)
    rows = []
    if args.prefill_len:  # prefill must not pay for a decode layout: side by side, best of the repeats
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, (engine, _) in engines.items():
                times[name].append(cairn_prefill_s(engine, args.prefill_len))
        for name in engines:
            rows.append({"dtype": dtype, "layout": name, "prefill_len": args.prefill_len,
                         "prefill_tok_s": args.prefill_len / min(times[name]), "prefill_runs_s": times[name]})
            print(f"  {dtype} {name} prefill{args.prefill_len}: {rows[-1]['prefill_tok_s']:.1f} tok/s", flush=True)
    for batch in args.batches:
        runs: dict[str, list[float]] = {name: [] for name in engines}
        runs["transformers"], bandwidth, own_read, gemm = [], [], [], []
        for _ in range(args.repeats):  # every side once per repeat, alternating
            bandwidth.append(read_bandwidth_gbs(buf))
            gemm.append(gemm_ceiling_gflops())
            own_read.append(stream_read_gbs(buf))
            for name, (engine, _) in engines.items():
                runs[name].append(cairn_decode_tok_s(engine, batch, args.new_tokens, args.prompt_len))
            if hf is not None:
                runs["transformers"].append(hf_decode_tok_s(hf, batch, args.new_tokens, args.prompt_len))
        hf_tok_s = max(runs["transformers"]) if hf is not None else None
        own = max(own_read) if None not in own_read else None
        for name, (_, weight_bytes) in engines.items():
            tok_s = max(runs[name])
            achieved = weight_bytes * tok_s / batch / 1e9  # steps/s x bytes per step
            rows.append({"dtype": dtype, "layout": name, "batch": batch, "tok_s": tok_s, "runs": runs[name],
                         "weight_bytes": weight_bytes, "weight_read_gbs": achieved,
                         "memory_bandwidth_gbs": max(bandwidth), "bandwidth_runs": bandwidth,
                         "fraction_of_bandwidth": achieved / max(bandwidth),
                         "stream_read_gbs": own, "stream_read_runs": own_read,
                         "gemm_gflops": max(gemm), "gemm_runs": gemm,
                         "fraction_of_gemm": 2 * macs * tok_s / 1e9 / max(gemm),
                         "fraction_of_stream_read": achieved / own if own else None,
                         "transformers_tok_s": hf_tok_s, "transformers_runs": runs["transformers"],
                         "vs_transformers": tok_s / hf_tok_s if hf_tok_s else None})
            print(f"  {dtype} {name} b{batch}: {tok_s:.2f} tok/s, {achieved:.1f} GB/s of {max(bandwidth):.1f}"
                  + (f" (own read {own:.1f})" if own else "")
                  + f", linears at {100 * rows[-1]['fraction_of_gemm']:.0f}% of a {max(gemm):.0f} GFLOP/s GEMM"
                  + (f", transformers {hf_tok_s:.2f} tok/s" if hf_tok_s else ""), flush=True)
    del engines
    gc.collect()
    return rows


def compile_pieces(batch: int) -> dict[str, tuple]:
    """name -> (function, calls of it per decode step of the 0.8B model, its arguments at `batch`)."""
    from cairn.layers.norm import GatedRMSNorm
    from cairn.ops.gdn import recurrent_gated_delta_rule
    from cairn.ops.norm import rms_norm

    gen = torch.Generator().manual_seed(batch)
    state = torch.randn(batch, 16, 128, 128, generator=gen) * 0.01
    q, k, v = (torch.randn(batch, 16, 128, generator=gen).bfloat16() for _ in range(3))
    g, beta = -torch.rand(batch, 16, generator=gen), torch.rand(batch, 16, generator=gen).bfloat16()
    norm_weight, gated = torch.zeros(1024).bfloat16(), GatedRMSNorm(128, 1e-6).bfloat16()
    x, o, z = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((batch, 1024), (batch, 16, 128),
                                                                             (batch, 16, 128)))
    return {"recurrent step": (recurrent_gated_delta_rule, 18, (q, k, v, g, beta, state)),
            "RMSNorm (layer, final)": (rms_norm, 49, (x, norm_weight, 1e-6, True)),  # what the layer's norm computes
            "gated RMSNorm (GDN)": (gated.forward, 18, (o, z))}


def compile_check(batches: list[int], repeats: int = 5) -> list[dict]:
    """Pieces of a decode step eager against torch.compile (dynamic shapes), side by side, per step."""
    rows = []
    for batch in batches:
        for name, (fn, calls, args) in compile_pieces(batch).items():
            compiled = torch.compile(fn, dynamic=True)
            t0 = time.perf_counter()
            with torch.inference_mode():
                compiled(*args)
                compile_s, times = time.perf_counter() - t0, {"eager": [], "compiled": []}
                for _ in range(repeats):
                    for side, f in (("eager", fn), ("compiled", compiled)):
                        t = time.perf_counter()
                        for _ in range(calls):
                            f(*args)
                        times[side].append(time.perf_counter() - t)
            eager_ms, compiled_ms = (1e3 * min(times[side]) for side in ("eager", "compiled"))
            rows.append({"piece": name, "batch": batch, "calls_per_step": calls, "first_call_s": compile_s,
                         "eager_ms": eager_ms, "compiled_ms": compiled_ms})
            print(f"  {name} b{batch}: eager {eager_ms:.2f} ms, torch.compile {compiled_ms:.2f} ms per step "
                  f"({calls} calls; first call {compile_s:.0f} s)", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| dtype | layout | batch | tok/s | weight MB/step | weight GB/s | memory GB/s | of limit "
             "| own read GB/s | of own read | GEMM GFLOP/s | of GEMM "
             "| transformers tok/s | vs transformers | vs batch 1 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    b1 = {(r["dtype"], r["layout"]): r["tok_s"] for r in rows if r.get("batch") == 1}
    for r in rows:
        if "prefill_len" in r:
            lines.append(f"| {r['dtype']} | {r['layout']} | prefill {r['prefill_len']} | {r['prefill_tok_s']:.1f} "
                         "| | | | | | | | | | | |")
            continue
        hf = f"{r['transformers_tok_s']:.2f}" if r["transformers_tok_s"] else "-"
        vs = f"{r['vs_transformers']:.2f}x" if r["vs_transformers"] else "-"
        base = b1.get((r["dtype"], r["layout"]))
        scale = f"{r['tok_s'] / base:.1f}x" if base else "-"
        own = (f"{r['stream_read_gbs']:.1f} | {100 * r['fraction_of_stream_read']:.0f}%" if r.get("stream_read_gbs")
               else "- | -")
        gemm = f"{r['gemm_gflops']:.0f} | {100 * r['fraction_of_gemm']:.0f}%" if r.get("gemm_gflops") else "- | -"
        lines.append(f"| {r['dtype']} | {r['layout']} | {r['batch']} | {r['tok_s']:.2f} "
                     f"| {r['weight_bytes'] / 1e6:.0f} | {r['weight_read_gbs']:.1f} | {r['memory_bandwidth_gbs']:.1f} "
                     f"| {100 * r['fraction_of_bandwidth']:.0f}% | {own} | {gemm} | {hf} | {vs} | {scale} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.8b", help="model size from engine_throughput.py: tiny or 0.8b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,4,16", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--layouts", default="plain,packed,gemv,int8",
                    help="cairn variants: plain, packed, gemv, gemv-unfused (gemv with the Gated DeltaNet decode on "
                    "the reference kernels instead of the fused op), gemv-sdpa (gemv with decode attention on SDPA "
                    "over gathered pages instead of cairn's paged op), gemv-avx512 (gemv on the AVX512-BF16 path, 2 "
                    "rows, F.linear above, where gemv takes AMX), gemv-rowmajor (gemv with every weight as loaded: "
                    "on the AVX2 path the row-major kernel, not the packed blocks), int8 (quantized: on cairn's AVX2 "
                    "kernel where gemv takes that path), int8-aten (quantized, on ATen's int8 kernel) or auto; "
                    "unsupported ones are skipped")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    ap.add_argument("--new-tokens", type=int, default=16, help="decode tokens timed per request")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512, help="also time a cold prefill of this many tokens "
                    "per layout (0: skip)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per point; the best is kept")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="size of the tensor read for the bandwidth")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--compile-check", action="store_true",
                    help="only time pieces of a decode step (recurrent step, norms) eager against torch.compile")
    ap.add_argument("--out", default=None, help="write the rows and the machine as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    if args.compile_check:
        rows = compile_check(args.batches)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"machine": cpu_info(), "compile_check": rows}, indent=2))
        return
    buf = torch.ones(int(args.bandwidth_gib * 2**30) // 4)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        hf = make_checkpoint(args.size, Path(d)).eval()
        for dtype in args.dtypes.split(","):
            rows += run_dtype(Path(d), hf, dtype, args, buf)
    machine = {"cpu": cpu_info(), "torch": torch.__version__, "threads": args.threads,
               "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}
    print(f"\n{machine['cpu']['model']} ({', '.join(machine['cpu']['flags'])}), torch {torch.__version__}, "
          f"{args.threads} threads, size {args.size}\n")
    print(table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
