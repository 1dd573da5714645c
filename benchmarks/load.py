"""Load benchmark of `cairn serve`: N concurrent streaming clients on loopback for a bounded time.

    python benchmarks/load.py                                 # starts a demo-model server itself
    python benchmarks/load.py --concurrency 32 --duration-s 60 --max-tokens 64
    python benchmarks/load.py --url http://127.0.0.1:8000 --server-pid 1234   # an already running server
    python benchmarks/load.py --concurrency 1,2,4,8,16 --plot benchmarks/figures/load_concurrency.png

Each client loops: one streamed /v1/completions request (a distinct prompt, `--max-tokens` tokens,
ignore_eos so every request has the same length), then the next, until the duration is over; requests
in flight at the deadline are finished and counted. Reports throughput (requests/s, output tokens/s),
time to first token p50 / p99, errors (should be 0) and the server's peak RSS (VmHWM from
/proc/<pid>/status) as a markdown table. With several `--concurrency` levels, the levels run one after
the other against the same server, one row each, and `--plot` draws throughput and time to first
token against concurrency. Not a test: it asserts nothing and exits 1 only on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class LoadResult:
    ttft_s: list[float] = field(default_factory=list)  # per completed request
    num_requests: int = 0  # completed without error
    num_output_tokens: int = 0  # from each response's usage
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0  # first request sent -> last response done


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(client: httpx.AsyncClient, body: dict, result: LoadResult) -> None:
    start = time.perf_counter()
    first_token_s, usage = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            result.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.errors.append(chunk["error"]["message"])
                return
            if chunk["choices"] and first_token_s is None:
                first_token_s = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if usage is None or first_token_s is None:
        result.errors.append("stream ended without tokens or usage")
        return
    result.ttft_s.append(first_token_s)
    result.num_requests += 1
    result.num_output_tokens += usage["completion_tokens"]


async def worker(client: httpx.AsyncClient, index: int, args: argparse.Namespace, deadline: float,
                 result: LoadResult) -> None:
    k = 0
    while time.perf_counter() < deadline:
        prompt = f"client {index} request {k}: " + "lorem ipsum " * (args.prompt_words // 2)
        body = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0.8, "stream_options": {"include_usage": True}}
        try:
            await one_request(client, body, result)
        except httpx.HTTPError as e:
            result.errors.append(f"{type(e).__name__}: {e}")
        k += 1


async def run_load(args: argparse.Namespace, concurrency: int) -> LoadResult:
    result = LoadResult()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout_s, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + args.duration_s
        await asyncio.gather(*(worker(client, i, args, deadline, result) for i in range(concurrency)))
        result.wall_s = time.perf_counter() - start
    return result


def peak_rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def start_demo_server(extra_args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w", prefix="cairn-load-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "cairn.cli", "serve", "--port", str(port), "--log-level", "WARNING", *extra_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.terminate()
    raise SystemExit(f"server did not become healthy; log: {log.name}")


def report(args: argparse.Namespace, rows: list[tuple[int, LoadResult]], rss_bytes: int | None) -> str:
    lines = [f"max_tokens {args.max_tokens}, prompt words {args.prompt_words}, clients start requests for "
             f"{args.duration_s:g} s per level; server peak RSS "
             + (f"{rss_bytes / 2**20:.0f} MiB" if rss_bytes else "n/a"), "",
             "| clients | duration | requests | requests/s | output tok/s | TTFT p50 | TTFT p99 | TTFT mean | errors |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for concurrency, r in rows:
        mean = f"{1000 * statistics.fmean(r.ttft_s):.0f} ms" if r.ttft_s else "n/a"
        lines.append(f"| {concurrency} | {r.wall_s:.1f} s | {r.num_requests} | {r.num_requests / r.wall_s:.2f} | "
                     f"{r.num_output_tokens / r.wall_s:.1f} | {1000 * percentile(r.ttft_s, 50):.0f} ms | "
                     f"{1000 * percentile(r.ttft_s, 99):.0f} ms | {mean} | {len(r.errors)} |")
    return "\n".join(lines)


def plot(rows: list[tuple[int, LoadResult]], path: Path) -> None:
    """Output tokens/s and time to first token (p50, p99) against the number of concurrent clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [c for c, _ in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [r.num_output_tokens / r.wall_s for _, r in rows], marker="o")
    left.set_ylabel("output tokens/s (all clients)")
    for q in (50, 99):
        right.plot(levels, [percentile(r.ttft_s, q) for _, r in rows], marker="o", label=f"p{q}")
    right.set_ylabel("time to first token (s)")
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streaming clients")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("cairn serve under load: throughput and time to first token against concurrency")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="base URL of a running server; default: start a demo-model server")
    p.add_argument("--server-pid", type=int, help="pid of the server at --url, for its peak RSS")
    p.add_argument("--server-args", default="--kv-cache-gib 0.25 --state-cache-gib 0.1 --max-num-seqs 64",
                   help="flags for the server this script starts")
    p.add_argument("--concurrency", default="16", help="concurrent streaming clients, or a comma-separated list of "
                   "levels run one after the other (default: 16)")
    p.add_argument("--plot", help="with several levels: draw throughput and TTFT against concurrency here (PNG)")
    p.add_argument("--duration-s", type=float, default=20.0, help="how long clients start requests (default: 20)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    p.add_argument("--prompt-words", type=int, default=40, help="approximate prompt length in words (default: 40)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout (default: 120)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    if args.url is None:
        proc, args.url = start_demo_server(args.server_args.split())
        args.server_pid = proc.pid
    rows = []
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            rows.append((concurrency, asyncio.run(run_load(args, concurrency))))
        rss = peak_rss_bytes(args.server_pid) if args.server_pid else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(report(args, rows, rss))
    if args.plot:
        plot(rows, Path(args.plot))
    errors = [e for _, r in rows for e in r.errors]
    for e in errors[:5]:
        print("error:", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
