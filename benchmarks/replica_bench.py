"""Replicas on one Redis: where each request is sent, and what the cache reuses (a benchmark, not a test).

For each setup, fresh `cairn serve` processes (the demo model, or random weights at --size's dimensions in
bfloat16) and an emptied redis-server, then the agentic and interleave workloads (cairn/bench/workloads.py,
the --preset sizes reshaped by --turns, --fractions and --scale) served one request at a time over HTTP,
each reply fed back into the workload as a client would:

    one          every request to one server (one cache: the upper bound of reuse)
    rr           --replicas servers that cache alone, requests in turn (today's field)
    rr-redis     --replicas servers sharing the Redis tier (--remote-cache), requests in turn
    router       --replicas servers sharing the Redis tier behind `cairn router`

Reported per setup and workload: cached tokens / the unlimited-cache oracle, tokens computed, and the total
time to first token (client wall time, the router's routing included); for the router, how many requests
it probed the replicas for. Starts its own redis-server on a free loopback port. Times are wall times on
whatever else the machine runs: compare setups within one run. With --trace, each setup sharing Redis also
prints, per request, what Redis held for its prompt when it was sent and when each request's writes
landed (benchmarks/replica_trace.py), and each replica's remote-tier counters (lookups that waited for
another replica's write, slices rewritten, faults).

    PYTHONPATH=. python benchmarks/replica_bench.py --preset smoke --out benchmarks/out/replica_bench.json
    PYTHONPATH=. python benchmarks/replica_bench.py --size 0.8b --preset published --turns 12 --fractions 0,0.6 \\
        --scale 1.5 --trace --out benchmarks/out/replica_bench_0.8b.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.replica_trace import RedisWatch, TracingRunner, print_turns, redis_input_rate, turns
from cairn.bench.checkpoint import SIZES, make_checkpoint
from cairn.bench.conversation import PRESETS, WorkloadSizes
from cairn.bench.http_runner import HTTPRunner
from cairn.bench.run import WorkloadResult, serve_stream, to_records
from cairn.bench.workloads import all_workloads
from cairn.request.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

WORKLOADS = ("agentic", "interleave")
SETUPS = {  # name -> (label, replicas: 1 or --replicas, shares Redis, behind the router)
    "one": ("one replica", False, False, False),
    "rr": ("{n} replicas, round robin, no Redis", True, False, False),
    "rr-redis": ("{n} replicas, round robin, one Redis", True, True, False),
    "router": ("{n} replicas, one Redis, `cairn router`", True, True, True),
}
SCALED_FIELDS = ("system_tokens", "message_tokens", "compaction_context_tokens", "instruction_tokens",
                 "tool_result_tokens", "interleave_tokens", "edit_context_tokens", "user_tokens")


REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_redis(log_dir: Path) -> Iterator[str]:
    """A redis-server without persistence on a free loopback port; yields its URL, stops it on exit."""
    import redis

    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(log_dir)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                redis.Redis.from_url(url).ping()
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


class Procs:
    """`cairn serve` and `cairn router` processes on free loopback ports, all stopped on exit (SIGTERM, then
    SIGKILL); each one's output goes to log_dir/NAME.log."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *_) -> None:
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def serve(self, flags: list[str], name: str) -> str:
        return self._start(["serve", *flags], name)

    def router(self, replicas: list[str]) -> str:
        return self._start(["router", *[f for r in replicas for f in ("--replica", r)]], "router")

    def _start(self, args: list[str], name: str) -> str:
        """Start `python -m cairn.cli ARGS --port N`; its URL once /health answers 200."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 (the child writes it until it is stopped)
        proc = subprocess.Popen([sys.executable, "-m", "cairn.cli", *args, "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: see {self.log_dir / (name + '.log')}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    return url
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not become healthy")


def workload_sizes(args: argparse.Namespace) -> WorkloadSizes:
    """The preset's sizes with --scale applied to every token length (not the reply) and --turns, --fractions."""
    sizes = PRESETS[args.preset]
    changes = {f: max(1, round(getattr(sizes, f) * args.scale)) for f in SCALED_FIELDS}
    if args.turns:
        changes["agentic_turns"] = args.turns
    if args.fractions:
        changes["shared_fractions"] = tuple(float(f) for f in args.fractions.split(","))
    return dataclasses.replace(sizes, **changes)


def model(args: argparse.Namespace) -> tuple[list[str], Tokenizer]:
    """The serve flags naming the model, and the client's tokenizer (the server's own)."""
    if args.size == "demo":
        return [], ByteTokenizer()
    path = Path(args.checkpoint_dir or Path(tempfile.gettempdir()) / f"cairn-checkpoint-{args.size}")
    if not (path / "config.json").is_file():
        print(f"writing random {args.size} weights to {path} ...", flush=True)
        path.mkdir(parents=True, exist_ok=True)
        make_checkpoint(args.size, path)
    return ["--model", str(path), "--dtype", "bfloat16"], HFTokenizer(path)


def run_setup(key: str, args: argparse.Namespace, redis_url: str, sizes: WorkloadSizes, model_flags: list[str],
              tokenizer: Tokenizer, log_dir: Path) -> list[dict]:
    label, several, shared, routed = SETUPS[key]
    label = label.format(n=args.replicas)
    flags = [*model_flags, *shlex.split(args.serve_flags), *(["--remote-cache", redis_url] if shared else [])]
    with Procs(log_dir) as procs:
        started = time.perf_counter()
        urls = [procs.serve(flags, f"{key}-{i}") for i in range(args.replicas if several else 1)]
        if routed:
            urls = [procs.router(urls)]
        print(f"{label}: {len(urls)} endpoint(s) up in {time.perf_counter() - started:.1f}s", flush=True)
        rows = []
        for workload in args.workloads.split(","):
            runner = TracingRunner([HTTPRunner(u, tokenizer) for u in urls])  # in turn (round robin)
            with RedisWatch(redis_url) if args.trace and shared else contextlib.nullcontext() as watch:
                served = serve_stream(all_workloads()[workload], runner, sizes, args.seed)
                time.sleep(args.trace_tail_s if watch else 0)  # let the last writes land while watched
            totals = WorkloadResult(workload, label, to_records(served)).totals()
            routing = httpx.get(urls[0] + "/health", timeout=30).json().get("routed_by") if routed else None
            trace = turns(runner.sent, watch) if watch else None
            served_by = [{"label": s.label, "replica": s.replica, "prompt_tokens": len(s.prompt_ids),
                          "cached_tokens": s.cached_tokens, "resume_tier": s.resume_tier} for s in runner.sent]
            rows.append({"setup": label, "workload": workload, **totals, "router_routed_by": routing,
                         "requests": served_by, "turns": trace,
                         "redis_peak_input_bytes_s": redis_input_rate(watch) if watch else None})
            if args.trace and not trace:
                print("  cached per request: " + ", ".join(f"{r['label']} {r['cached_tokens']}" for r in served_by))
            if trace:
                print_turns(trace)
                for url in urls:  # what each replica counted of the remote tier (faults, waits, lookups)
                    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
                    print(f"  {url}: " + "; ".join(line.removeprefix("cairn_cache_") for line in lines
                                                   if line.startswith("cairn_cache_remote_")))
                print(f"Redis received at most {rows[-1]['redis_peak_input_bytes_s'] / 1e6:.0f} MB/s", flush=True)
            print(f"{label:>26} {workload:>10}: reused/oracle {100 * (totals['reuse_of_oracle'] or 0):5.1f}% "
                  f"({totals['cached_tokens']}/{totals['oracle_tokens']}), computed {totals['computed_tokens']}, "
                  f"total TTFT {totals['ttft_total_s']:.2f}s" + (f", routed {routing}" if routing else ""), flush=True)
        return rows


def table(rows: list[dict]) -> str:
    """The BENCHMARKS.md table: one line per setup, agentic then interleave."""
    lines = ["| setup | agentic reused / oracle | agentic total TTFT | interleave reused / oracle | "
             "interleave total TTFT |", "|---|---:|---:|---:|---:|"]
    for setup in dict.fromkeys(r["setup"] for r in rows):
        cells = []
        for workload in WORKLOADS:
            r = next((r for r in rows if r["setup"] == setup and r["workload"] == workload), None)
            cells += ["", ""] if r is None else [
                f"{100 * (r['reuse_of_oracle'] or 0):.1f}% ({r['cached_tokens']:,} / {r['oracle_tokens']:,})",
                f"{r['ttft_total_s']:.2f} s"]
        lines.append(f"| {setup} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="demo", choices=("demo", *SIZES),
                        help="the demo model, or random weights at these dimensions (bfloat16)")
    parser.add_argument("--checkpoint-dir", help="where --size's checkpoint is written once and reused; "
                        "default: $TMPDIR/cairn-checkpoint-SIZE")
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the round-robin and router setups")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, of: " + ", ".join(SETUPS))
    parser.add_argument("--preset", default="smoke", choices=sorted(PRESETS))
    parser.add_argument("--turns", type=int, default=0, help="agentic requests (default: the preset's)")
    parser.add_argument("--fractions", default="", help="interleave: shares of A that each B starts with, e.g. "
                        "0,0.6 (default: the preset's)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every token length of the preset")
    parser.add_argument("--serve-flags", default="", help="more `cairn serve` flags for every replica, quoted")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true", help="with Redis: per request, what Redis held for its "
                        "prompt when it was sent and when each request's writes landed (benchmarks/replica_trace.py)")
    parser.add_argument("--trace-tail-s", type=float, default=5.0, help="--trace: seconds watched after a workload")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers and Redis on the way out
    setups = args.setups.split(",")
    unknown = set(setups) - set(SETUPS)
    if unknown:
        raise SystemExit(f"unknown setups {sorted(unknown)}: choose among {', '.join(SETUPS)}")
    sizes, (model_flags, tokenizer) = workload_sizes(args), model(args)
    log_dir = Path(tempfile.mkdtemp(prefix="cairn-replica-bench-"))
    started, rows = time.perf_counter(), []
    with start_redis(log_dir) as redis_url:
        import redis

        for key in setups:
            redis.Redis.from_url(redis_url).flushall()
            rows += run_setup(key, args, redis_url, sizes, model_flags, tokenizer, log_dir)
    elapsed_s = time.perf_counter() - started
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"size": args.size, "replicas": args.replicas, "preset": args.preset,
                                        "sizes": dataclasses.asdict(sizes), "serve_flags": args.serve_flags,
                                        "elapsed_s": elapsed_s, "rows": rows}, indent=1))
    print(f"\n{table(rows)}\n\n{elapsed_s:.0f}s in all; logs in {log_dir}")


if __name__ == "__main__":
    main()
