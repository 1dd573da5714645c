"""Replicas on one Redis: where each request is sent, and what the cache reuses (a benchmark, not a test).

For each setup, fresh `cairn serve` processes (demo model) and an emptied redis-server, then the agentic
and interleave workloads (cairn/bench/workloads.py, the --preset sizes) served one request at a time over
HTTP, each reply fed back into the workload as a client would:

    one replica            every request to one server (one cache: the upper bound of reuse)
    round robin, no Redis  two replicas that cache alone, requests alternating between them (today's field)
    round robin            two replicas sharing the Redis tier (--remote-cache), requests alternating
    router                 two replicas sharing the Redis tier behind `cairn router`

Reported per setup and workload: cached tokens / the unlimited-cache oracle, and the total time to first
token. Starts its own redis-server on a free loopback port. Times are wall times on whatever else the
machine runs: compare setups within one run.

    PYTHONPATH=. python benchmarks/replica_bench.py --preset smoke --out benchmarks/out/replica_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from cairn.bench.conversation import PRESETS, BenchRequest
from cairn.bench.http_runner import HTTPRunner
from cairn.bench.run import Served, WorkloadResult, serve_stream, to_records
from cairn.bench.workloads import all_workloads
from cairn.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("agentic", "interleave")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], health_url: str, log_dir: Path, name: str) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (the child writes it until it is stopped)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: see {log_dir / (name + '.log')}")
        try:
            if httpx.get(health_url, timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not become healthy")


def start_redis(log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(log_dir)], stdout=subprocess.DEVNULL)
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def serve(flags: list[str], log_dir: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cairn.cli", "serve", "--port", str(port), *flags]
    return start(cmd, url + "/health", log_dir, name), url


def router(replicas: list[str], log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cairn.cli", "router", "--port", str(port),
           *[f for r in replicas for f in ("--replica", r)]]
    return start(cmd, url + "/health", log_dir, "router"), url


class RoundRobin:
    """The bench's Runner over several HTTP runners, each request to the next in turn."""

    def __init__(self, runners: list[HTTPRunner]):
        self.runners, self.tokenizer, self._turn = runners, runners[0].tokenizer, 0

    def serve(self, request: BenchRequest) -> Served:
        runner = self.runners[self._turn % len(self.runners)]
        self._turn += 1
        return runner.serve(request)


def run_setup(name: str, redis_url: str | None, num_replicas: int, use_router: bool, preset: str, seed: int,
              log_dir: Path) -> list[dict]:
    procs = []
    try:
        flags = ["--remote-cache", redis_url] if redis_url else []
        urls = []
        for i in range(num_replicas):
            proc, url = serve(flags, log_dir, f"{name.replace(' ', '_')}-{i}")
            procs.append(proc)
            urls.append(url)
        if use_router:
            proc, url = router(urls, log_dir)
            procs.append(proc)
            urls = [url]
        tokenizer = ByteTokenizer()
        runner = RoundRobin([HTTPRunner(u, tokenizer) for u in urls])
        rows = []
        for workload in WORKLOADS:
            served = serve_stream(all_workloads()[workload], runner, PRESETS[preset], seed)
            totals = WorkloadResult(workload, name, to_records(served)).totals()
            rows.append({"setup": name, "workload": workload, **totals})
            print(f"{name:>22} {workload:>10}: reused/oracle {100 * (totals['reuse_of_oracle'] or 0):5.1f}% "
                  f"({totals['cached_tokens']}/{totals['oracle_tokens']}), total TTFT {totals['ttft_total_s']:.2f}s",
                  flush=True)
        return rows
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="smoke", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="cairn-replica-bench-"))
    redis_proc, redis_url = start_redis(log_dir)
    import redis

    rows = []
    try:
        for name, url, n, routed in [("one replica", None, 1, False), ("round robin, no Redis", None, 2, False),
                                     ("round robin", redis_url, 2, False), ("router", redis_url, 2, True)]:
            redis.Redis.from_url(redis_url).flushall()
            rows += run_setup(name, url, n, routed, args.preset, args.seed, log_dir)
    finally:
        redis_proc.terminate()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"preset": args.preset, "rows": rows}, indent=1))
    print(f"logs in {log_dir}")


if __name__ == "__main__":
    main()
