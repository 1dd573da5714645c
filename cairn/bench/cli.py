"""`cairn bench` / `python -m cairn.bench`: run the workloads under each cache policy and write the record.

    cairn bench [--workloads all|a,b] [--policies all|a,b] [--preset smoke|published]
                [--size demo|tiny|0.8b|nemotron-h-tiny|nemotron-h-4b] [--out DIR]
                [--url URL [--tokenizer DIR]] [engine flags...]

In-process (the default), every (workload, policy) pair gets a fresh Engine built from the same
engine flags (same weights, pools, budgets and chunk size; `--snapshot-policy` and
`--snapshot-min-gap` are set per policy). With `--url`, the workloads go to a running server and
are reported under the policy name `server`. Writes `record.json`, `report.md` and the PNGs to
`--out`, and prints the per-request rows and the summary.

What it is not: the workloads (workloads.py, sessions.py) or the measurements (the runners).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from cairn.bench.checkpoint import SIZES, make_checkpoint
from cairn.bench.conversation import PRESETS, Workload, WorkloadSizes
from cairn.bench.policies import LABELS, POLICIES, SMOKE_MIN_GAP_TOKENS, parse_names, policy_config
from cairn.bench.record import SCHEMA, BenchRecord, WorkloadResult, evaluate_targets
from cairn.bench.report import report, requests_table
from cairn.bench.workloads import all_workloads
from cairn.config import RANDOM_DEMO_NAME, EngineConfig
from cairn.flags import add_dataclass_args, add_engine_args, build_group, config_from_args
from cairn.preflight import check_model
from cairn.request.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

SERVER_POLICY = "server"


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class BenchOptions:
    workloads: str = _f("all", "comma-separated workloads, or all: " + ", ".join(all_workloads()))
    policies: str = _f("all", "comma-separated cache policies, or all: " + ", ".join(POLICIES))
    preset: str = _f("smoke", "workload sizes", choices=tuple(PRESETS))
    size: str = _f("demo", "model: the demo model (or --model DIR), or random weights at these dimensions "
                   "(0.8b = Qwen3.5-0.8B, nemotron-h-4b = Nemotron-H-4B; cairn.bench.checkpoint makes them, "
                   "as for benchmarks/)", choices=("demo", *SIZES))
    checkpoint_dir: str | None = _f(None, "where the --size checkpoint is written and reused; default: a temp dir")
    workload_seed: int = _f(0, "seed of the workloads' text (the demo weights' seed is --demo-seed)")
    out: str = _f("benchmarks/out/bench", "directory for record.json, report.md and the PNGs")
    url: str | None = _f(None, "run against this server (e.g. http://127.0.0.1:8000) instead of in-process")
    tokenizer: str | None = _f(None, "over --url: checkpoint directory of the server's tokenizer; default: the "
                               "demo's byte tokenizer")
    server_model: str | None = _f(None, "over --url: the model name to send; default: the server's first model")
    threads: int = _f(1, "torch CPU threads (0: torch's default, one per core); 1 keeps times steady, and on a "
                      "loaded machine torch's default can be 10x slower")
    plots: bool = _f(True, "write the PNG plots")
    verbose: bool = _f(False, "also print each run's progress line and every request's row (the report without "
                       "them fits one screen; report.md and record.json hold everything either way)")


# The engine flags `cairn bench` sets per policy (--policies picks them), and the engine defaults it
# changes: with no flags, `cairn bench` is the smoke run that BENCHMARKS.md publishes.
PER_POLICY_FLAGS = frozenset({"snapshot_policy", "prefix_cache"})
ENGINE_DEFAULTS = {"max_num_batched_tokens": 256, "snapshot_min_gap": SMOKE_MIN_GAP_TOKENS}


def add_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, BenchOptions, "bench options")
    add_engine_args(parser, exclude=PER_POLICY_FLAGS, defaults=ENGINE_DEFAULTS)


def run(ns: argparse.Namespace) -> int:
    check_model(ns.model)
    flags = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]  # `cairn bench ...` or `-m cairn.bench ...`
    bench(build_group(BenchOptions, ns), config_from_args(ns), command=shlex.join(["cairn", "bench", *flags]))
    return 0


def bench(opts: BenchOptions, base: EngineConfig, command: str = "", sizes: WorkloadSizes | None = None
          ) -> BenchRecord:
    """Run every selected (workload, policy), then write and print the record. Returns it.

    `sizes` replaces the preset's sizes (the record then names the preset "custom")."""
    import torch  # here, not at the top: `cairn --help` builds this parser and should not import torch

    catalogue = all_workloads()
    workloads = [catalogue[n] for n in parse_names(opts.workloads, list(catalogue), "workloads")]
    if sizes is not None:
        opts = dataclasses.replace(opts, preset="custom")
    sizes = sizes or PRESETS[opts.preset]
    out = Path(opts.out)
    with ExitStack() as stack:
        if opts.threads:
            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(opts.threads)
        base, model = _resolve_model(opts, base, stack)
        if opts.url:
            policies = [SERVER_POLICY]
            results = _over_http(opts, workloads, sizes, _client_tokenizer(opts, base))
        else:
            policies = parse_names(opts.policies, POLICIES, "policies")
            results = _in_process(opts, base, workloads, policies, sizes)
        env = environment(base)
    record = BenchRecord(SCHEMA, datetime.now(UTC).isoformat(timespec="seconds"), command,
                         opts.url or "engine", model, _size_label(opts, base), opts.preset, opts.workload_seed,
                         base.cache.snapshot_min_gap, {} if opts.url else dataclasses.asdict(base),
                         dataclasses.asdict(sizes), policies, [w.name for w in workloads], env, results)
    record.targets = evaluate_targets(results, SERVER_POLICY if opts.url else "cairn")
    if opts.plots:
        record.plots = [str(p) for p in _plot_all(results, out, SERVER_POLICY if opts.url else "cairn")]
    record.write(out / "record.json")
    text = report(record)
    (out / "report.md").write_text(text)
    print("\n" + text + f"\nrecord: {out / 'record.json'}" + "".join(f"\nplot: {p}" for p in record.plots))
    return record


def _plot_all(results, out: Path, policy: str) -> list[Path]:
    """The PNG plots; matplotlib is the `bench` extra, so a missing one is named, not a traceback."""
    try:
        from cairn.bench.plots import plot_all
    except ModuleNotFoundError as e:
        hint = "pip install 'cairn[bench]' or pass --no-plots"
        raise SystemExit(f"cairn bench: plots need matplotlib ({e}); {hint}") from None
    return plot_all(results, out, policy)


def _in_process(opts: BenchOptions, base: EngineConfig, workloads: list[Workload], policies: list[str],
                sizes: WorkloadSizes) -> list[WorkloadResult]:
    from cairn.bench.engine_runner import EngineRunner
    from cairn.bench.run import run_workload

    results = []
    for workload in workloads:
        for policy in policies:
            with tempfile.TemporaryDirectory(prefix="cairn-bench-disk-") as disk:
                config = policy_config(base, policy, Path(disk) if workload.needs_disk_tier
                                       else None)
                start_s = time.perf_counter()
                result = run_workload(workload, policy, lambda c=config: EngineRunner(c), sizes, opts.workload_seed)
            _progress(opts, result, time.perf_counter() - start_s)
            results.append(result)
    return results


def _over_http(opts: BenchOptions, workloads: list[Workload], sizes: WorkloadSizes,
               tokenizer: Tokenizer) -> list[WorkloadResult]:
    from cairn.bench.http_runner import HTTPRunner
    from cairn.bench.run import run_workload

    results = []
    for workload in workloads:
        skip = "the HTTP runner cannot restart the server (run it in-process)" if workload.needs_disk_tier else None
        start_s = time.perf_counter()
        result = run_workload(workload, SERVER_POLICY, lambda: HTTPRunner(opts.url, tokenizer, opts.server_model),
                              sizes, opts.workload_seed, skip)
        _progress(opts, result, time.perf_counter() - start_s)
        results.append(result)
    return results


def _progress(opts: BenchOptions, result: WorkloadResult, wall_s: float) -> None:
    if not opts.verbose:
        return
    name = f"{result.workload} / {LABELS.get(result.policy, result.policy)}"
    if result.skipped:
        print(f"{name}: skipped: {result.skipped}", flush=True)
        return
    t = result.totals()
    reuse = "n/a" if t["reuse_of_oracle"] is None else f"{100 * t['reuse_of_oracle']:.1f}%"
    print(f"{name}: {t['num_requests']} requests, cached {t['cached_tokens']:,} of oracle {t['oracle_tokens']:,} "
          f"({reuse}), TTFT total {t['ttft_total_s']:.2f} s, wall {wall_s:.1f} s", flush=True)
    print(requests_table(result) + "\n", flush=True)


def _resolve_model(opts: BenchOptions, base: EngineConfig, stack: ExitStack) -> tuple[EngineConfig, str]:
    """The engine config with --size's checkpoint in place (made if absent), and the model's name."""
    if opts.size == "demo":
        return base, base.model.model or RANDOM_DEMO_NAME
    if base.model.model:
        raise SystemExit("cairn bench: give --size or --model, not both")
    path = Path(opts.checkpoint_dir) if opts.checkpoint_dir else Path(stack.enter_context(
        tempfile.TemporaryDirectory(prefix=f"cairn-bench-{opts.size}-")))
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        _make_checkpoint(opts.size, path)
    return dataclasses.replace(base, model=dataclasses.replace(base.model, model=str(path))), str(path)


def _make_checkpoint(size: str, path: Path) -> None:
    """Random weights at `size` (cairn.bench.checkpoint); transformers, which writes them, is the bench extra."""
    try:
        make_checkpoint(size, path)
    except ModuleNotFoundError as e:
        raise SystemExit(f"cairn bench --size {size} needs transformers ({e}): pip install 'cairn[bench]'") from None


def _client_tokenizer(opts: BenchOptions, base: EngineConfig) -> Tokenizer:
    path = opts.tokenizer or base.model.model
    return HFTokenizer(path) if path else ByteTokenizer()


def _size_label(opts: BenchOptions, base: EngineConfig) -> str:
    return opts.size if opts.size != "demo" or not base.model.model else "checkpoint"


def environment(base: EngineConfig) -> dict:
    """What the figures depend on beside the record's own fields."""
    import torch

    try:
        root = Path(__file__).resolve().parents[2]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    device = base.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "platform": platform.platform(), "device": device, "git": commit}
