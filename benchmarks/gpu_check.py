"""The one GPU check of the fast CUDA kernels (issue 14 point 4): imports, correctness, speed, in one run.

    python benchmarks/gpu_check.py                    # on a CUDA machine: writes $OUT/gpu_check.{json,md}
    python benchmarks/gpu_check.py --dry-run          # on CPU, tiny sizes: the harness itself (a test runs it)

1. Which fast-kernel libraries import (triton, fla, causal_conv1d, flashinfer), with versions or errors.
2. Every fast kernel against the reference kernels, per shape ("tiny" and the Qwen3.5-0.8B dims), in
   bfloat16: both are compared with the reference run in float32 on the same (bf16-rounded) inputs, and a
   fast kernel passes when its error is within max(1e-3, 2x the bf16 reference's own error): bf16 outputs
   of magnitude ~1 carry a rounding step of 4e-3, so a flat 1e-3 would fail the reference itself. A
   kernel with no fast version is reported as "reference" (on CPU every row compares the reference with
   itself: the path the test checks). Whole models too: greedy tokens and their log-probabilities, fast
   against reference kernels, on the random checkpoints of each size.
3. Prefill and decode tok/s and the compaction-replay time to first token (BENCHMARKS.md, "Time to first
   token per resume tier", its row "compaction replay, 70% kept plus 64 tokens (cache_bench)": a conversation
   cut back to 70% plus a 64-token instruction, resumed from the deepest snapshot below the cut), reference
   and fast kernels side by side, at the largest size.
4. CUDA graphs for decode (`--cuda-graphs`, cairn/decode_graphs.py) at the largest size, both sides on the graph
   path's kernels: greedy tokens and log-probabilities of graph replay against the eager engine, and decode tok/s
   of both, alternated. On CPU (--dry-run) the graph side runs the checking stand-in (cairn/ops/graph_check.py):
   the same static-buffer path, proven graph-safe at every replay, not faster.

Absent libraries are skipped (their kernels stay the reference), so the script runs on an image without
any of them. See docs/gpu.md for the wheels to carry and the command line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cache_bench import ttft_s
from benchmarks.engine_throughput import cairn_decode_tok_s, prompt
from benchmarks.gpu_kernel_cases import CASES, SHAPES
from cairn.bench.checkpoint import make_checkpoint
from cairn.ops import REFERENCE, Kernels, select_kernels

LIBRARIES = ("triton", "fla", "causal_conv1d", "flashinfer")


def imports() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "imported")
        except Exception as e:  # absent, or a build for another torch / CUDA
            found[name] = f"absent: {type(e).__name__}: {str(e)[:120]}"
    return found


def max_err(got: list[torch.Tensor], truth: list[torch.Tensor]) -> float:
    return max((g.float() - t.float()).abs().max().item() for g, t in zip(got, truth, strict=True))


def kernel_rows(fast: Kernels, shapes: list[str], device: str) -> list[dict]:
    rows = []
    for shape in shapes:
        for name, (field, make_inputs, run) in CASES.items():
            inputs = make_inputs(SHAPES[shape], device)
            truth = run(REFERENCE, inputs, torch.float32)
            ref = run(REFERENCE, inputs, torch.bfloat16)
            impl = getattr(fast, field)
            is_fast = impl is not getattr(REFERENCE, field)
            try:
                got, error = run(fast, inputs, torch.bfloat16), None
            except Exception as e:  # a fast kernel that refuses these shapes is a finding, not a crash
                got, error = None, f"{type(e).__name__}: {str(e)[:200]}"
            row = {"shape": shape, "case": name, "kernel": "fast" if is_fast else "reference",
                   "ref_bf16_err": max_err(ref, truth), "error": error}
            row["fast_err"] = None if got is None else max_err(got, truth)
            row["tolerance"] = max(1e-3, 2 * row["ref_bf16_err"])
            row["pass"] = got is not None and row["fast_err"] <= row["tolerance"]
            rows.append(row)
    return rows


def engine(path: Path, device: str, fast: bool, args, graphs: bool = False):
    """An engine on the checkpoint; `graphs`: the decode graph path (CUDA graphs on CUDA, else the checking
    stand-in)."""
    from cairn.config import CacheOptions, EngineConfig, MemoryOptions, ModelOptions, SchedulerOptions
    from cairn.engine.engine import Engine
    from cairn.ops.graph_check import CheckingGraphBackend

    cuda_graphs = graphs and device.startswith("cuda")
    stand_in = CheckingGraphBackend() if graphs and not cuda_graphs else None
    cfg = EngineConfig(ModelOptions(model=str(path), dtype="bfloat16", device=device, fast_kernels=fast,
                                    cuda_graphs=cuda_graphs),
                       MemoryOptions(page_size=16, kv_cache_gib=2.0, state_cache_gib=1.0),
                       SchedulerOptions(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=args.context + 512,
                                        prefill_block=args.prefill_block),
                       CacheOptions(prefix_cache=True, snapshot_interval=args.snapshot_interval,
                                    device_snapshot_gib=2.0, host_cache_gib=0.0))
    return Engine(cfg, show_progress=False, graph_backend=stand_in)


def greedy(eng, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their log-probabilities per prompt, the prompts together, the cache not used."""
    from cairn.request.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=True, cache_prompt=False)
    ids = [eng.add_request(p, params) for p in prompts]
    got = {i: ([], []) for i in ids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id][0].extend(out.delta_token_ids)
            got[out.request_id][1].extend(out.delta_logprobs)
    return [got[i][0] for i in ids], [got[i][1] for i in ids]


def model_row(ref_eng, fast_eng, size: str, prompt_len: int, tokens: int) -> dict:
    prompts = [prompt(prompt_len, seed=s) for s in (1, 2, 3)]
    ref_tokens, ref_lp = greedy(ref_eng, prompts, tokens)
    fast_tokens, fast_lp = greedy(fast_eng, prompts, tokens)
    same = [sum(a == b for a, b in zip(r, f, strict=True)) for r, f in zip(ref_tokens, fast_tokens, strict=True)]
    # log-probabilities compared up to the first differing token (after it the contexts differ)
    diffs = [abs(a - b) for r, f, rl, fl in zip(ref_tokens, fast_tokens, ref_lp, fast_lp, strict=True)
             for (x, y, a, b) in zip(r, f, rl, fl, strict=True) if x == y]
    return {"size": size, "kernels": fast_eng.model.kernels.name, "tokens_equal": sum(same),
            "tokens": tokens * len(prompts), "max_logprob_diff": max(diffs, default=None)}


def speed_rows(engines: dict, args) -> list[dict]:
    """Each figure for the reference and the fast kernels, alternated, the best of `repeats` kept."""
    rows = []
    for eng in engines.values():
        ttft_s(eng, prompt(args.prefill_len, seed=7), cache=False)  # warm-up (allocations, kernel builds)
        cairn_decode_tok_s(eng, 1, 4, 32, cache_prompt=False)
    figures = {name: {} for name in engines}
    for _ in range(args.repeats):
        for name, eng in engines.items():
            f = figures[name]
            seconds, _ = ttft_s(eng, prompt(args.prefill_len, seed=11), cache=False)
            f["prefill_tok_s"] = max(f.get("prefill_tok_s", 0), args.prefill_len / seconds)
            for b in args.batches:
                key = f"decode_b{b}_tok_s"
                f[key] = max(f.get(key, 0), cairn_decode_tok_s(eng, b, args.decode_tokens, 32, cache_prompt=False))
    for name, f in figures.items():
        rows.append({"kernels": engines[name].model.kernels.name, "side": name, **f})
    return rows


def graph_rows(eager, graphed, size: str, args) -> list[dict]:
    """Graph replay against the eager engine, both on the graph path's kernels (decode attention read by page table,
    cuda_graphs.graph_kernels), so that what differs is the replay alone: greedy tokens and log-probabilities of
    three prompts decoded together (bucket 4, one padding row), then decode tok/s of both, alternated."""
    kernels = eager.model.kernels
    eager.model.kernels = graphed.model.kernels
    try:
        return [graph_row(eager, graphed, size, args)]
    finally:
        eager.model.kernels = kernels


def graph_row(eager, graphed, size: str, args) -> dict:
    prompts = [prompt(100, seed=s) for s in (1, 2, 3)]
    eager_tokens, eager_lp = greedy(eager, prompts, 8)
    graph_tokens, graph_lp = greedy(graphed, prompts, 8)
    diffs = [abs(a - b) for r, g, rl, gl in zip(eager_tokens, graph_tokens, eager_lp, graph_lp, strict=True)
             for (x, y, a, b) in zip(r, g, rl, gl, strict=True) if x == y]
    row = {"size": size, "backend": graphed.runner.graphs.backend.name, "buckets": graphed.runner.graphs.buckets,
           "tokens_equal": sum(a == b for r, g in zip(eager_tokens, graph_tokens, strict=True)
                               for a, b in zip(r, g, strict=True)),
           "tokens": 8 * len(prompts), "max_logprob_diff": max(diffs, default=None)}
    for b in args.batches:  # first use of each bucket captures it: untimed
        for eng in (eager, graphed):
            cairn_decode_tok_s(eng, b, 2, 32, cache_prompt=False)
    for _ in range(args.repeats):
        for side, eng in (("eager", eager), ("graphs", graphed)):
            for b in args.batches:
                key = f"{side}_decode_b{b}_tok_s"
                row[key] = max(row.get(key, 0), cairn_decode_tok_s(eng, b, args.decode_tokens, 32, cache_prompt=False))
    return row


def replay_rows(engines: dict, context: int, instruction: int = 64) -> list[dict]:
    keep = int(0.7 * context)
    rows = []
    for name, eng in engines.items():
        conversation = prompt(context, seed=1 + len(rows))  # its own conversation per side: both start cold
        ttft_s(eng, conversation)  # cached with its snapshots
        replay = conversation[:keep] + prompt(instruction, seed=2)
        warm_s, out = ttft_s(eng, replay)
        cold_s, _ = ttft_s(eng, replay, cache=False)
        rows.append({"side": name, "kernels": eng.model.kernels.name, "context": context, "replay_tokens": len(replay),
                     "resumed_at": out.cache.resume_position, "ttft_warm_s": warm_s, "ttft_cold_s": cold_s})
    return rows


def table(result: dict) -> str:
    lines = [f"device: {result['device']}", "", "| library | import |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in result["imports"].items()]
    lines += ["", "| shape | case | kernel | fast err | ref bf16 err | tolerance | pass |",
              "|---|---|---|---:|---:|---:|---|"]
    for r in result["kernels"]:
        err = r["error"] if r["fast_err"] is None else f"{r['fast_err']:.2e}"
        lines.append(f"| {r['shape']} | {r['case']} | {r['kernel']} | {err} | {r['ref_bf16_err']:.2e} | "
                     f"{r['tolerance']:.2e} | {'yes' if r['pass'] else '**no**'} |")
    lines += ["", "| size | kernels | tokens equal | max logprob diff |", "|---|---|---:|---:|"]
    for r in result["models"]:
        lines.append(f"| {r['size']} | {r['kernels']} | {r['tokens_equal']}/{r['tokens']} | {r['max_logprob_diff']} |")
    lines += ["", "| side | kernels | figure | value |", "|---|---|---|---:|"]
    for r in result["speed"]:
        lines += [f"| {r['side']} | {r['kernels']} | {k} | {v:.1f} |" for k, v in r.items() if k.endswith("tok_s")]
    for r in result["replay"]:
        lines += [f"| {r['side']} | {r['kernels']} | compaction replay TTFT warm (resumed at {r['resumed_at']}) | "
                  f"{r['ttft_warm_s']:.3f} s |",
                  f"| {r['side']} | {r['kernels']} | compaction replay TTFT cold | {r['ttft_cold_s']:.3f} s |"]
    lines += ["", "| size | decode graphs | tokens equal | max logprob diff | batch | eager tok/s | graphs tok/s |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["graphs"]:
        for b in [int(k.split("_b")[1].split("_")[0]) for k in r if k.startswith("eager_decode_b")]:
            lines.append(f"| {r['size']} | {r['backend']} | {r['tokens_equal']}/{r['tokens']} | "
                         f"{r['max_logprob_diff']} | {b} | {r[f'eager_decode_b{b}_tok_s']:.1f} | "
                         f"{r[f'graphs_decode_b{b}_tok_s']:.1f} |")
    lines += ["", *(f"error: {e}" for e in result["errors"])]
    return "\n".join(lines)


class Parts:
    """Runs the check's parts in order: a part that fails is recorded in result["errors"] and the rest still
    run; one not started within the time budget is skipped; the JSON is rewritten after each part, so a run
    cut short by the device call's time limit leaves what it had."""

    def __init__(self, result: dict, out: Path, budget_s: float):
        self.result, self.out, self.budget_s, self.started = result, out, budget_s, time.perf_counter()

    def run(self, name: str, step) -> None:
        if time.perf_counter() - self.started > self.budget_s:
            self.result["errors"].append(f"{name}: skipped, past the {self.budget_s} s budget")
        else:
            try:
                step()
            except Exception as e:
                self.result["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=2))


def model_parts(parts: Parts, args, size: str, timed: bool, folder: str) -> None:
    """The whole-model check at one size, then (for the timed size) the speed and the replay figures."""
    result, engines = parts.result, {}

    def load() -> None:
        path = Path(folder) / size
        make_checkpoint(size, path)
        for side in ("reference", "fast"):
            engines[side] = engine(path, args.device, side == "fast", args)
        result["models"].append(model_row(engines["reference"], engines["fast"], size, 100, 8))

    parts.run(f"model {size}", load)
    if timed and len(engines) == 2:
        result["speed_size"] = size

        def graphs() -> None:
            graphed = engine(Path(folder) / size, args.device, False, args, graphs=True)
            result["graphs"].extend(graph_rows(engines["reference"], graphed, size, args))
            del graphed

        parts.run("graphs", graphs)
        parts.run("speed", lambda: result["speed"].extend(speed_rows(engines, args)))
        parts.run("replay", lambda: result["replay"].extend(replay_rows(engines, args.context)))


def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes and lengths: checks the harness")
    ap.add_argument("--sizes", default="tiny,0.8b", help="checkpoint sizes (cairn.bench.checkpoint); the last "
                                                         "one is timed")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="kernel-check shapes (benchmarks/gpu_kernel_cases.py)")
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--context", type=int, default=4096, help="compaction replay: the cached conversation")
    ap.add_argument("--snapshot-interval", type=int, default=1024)
    ap.add_argument("--prefill-block", type=int, default=None, help="default: the engine's (512 in bf16)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=420, help="parts not started by then are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/out", help="directory (default $OUT)")
    if ap.parse_known_args(argv)[0].dry_run:  # smaller defaults; options given still win
        ap.set_defaults(device="cpu", sizes="tiny", shapes="tiny", prefill_len=64, decode_tokens=4, batches=[1, 2],
                        context=160, snapshot_interval=64, prefill_block=64, repeats=1)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fast = select_kernels(args.device, fast=True)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch": torch.__version__, "imports": imports(), "fast_kernels": fast.name, "kernels": [],
              "models": [], "speed": [], "replay": [], "graphs": [], "errors": []}
    parts = Parts(result, out, args.budget_s)
    parts.run("kernels", lambda: result["kernels"].extend(kernel_rows(fast, args.shapes.split(","), args.device)))
    sizes = args.sizes.split(",")
    with tempfile.TemporaryDirectory() as folder:
        for size in sizes:
            model_parts(parts, args, size, size == sizes[-1], folder)
    (out / "gpu_check.md").write_text(table(result) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
