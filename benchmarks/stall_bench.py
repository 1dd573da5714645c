"""Does a huge request stall the other streams? Inter-token latency of a running stream while a
20 MiB request arrives, on a real `cairn serve` (demo model).

    python benchmarks/stall_bench.py                          # this checkout, 3 rounds
    python benchmarks/stall_bench.py --repo /tmp/cairn-before  # also an older checkout, alternating
    python benchmarks/stall_bench.py --out benchmarks/out/stall_bench.json  # the rounds as JSON too
    python benchmarks/stall_bench.py --server-flags="--model /tmp/cairn-checkpoint-0.8b --dtype bfloat16"

For each round: start one streamed /v1/completions request (ignore_eos, many tokens), let it run
`--warmup-tokens` tokens, then send one `--big-mib` MiB request (a chat whose one message holds
that much text, or with `--big-kind completion` a text prompt) and wait for its answer (a 400: it
is over the context; what matters is what the engine thread does meanwhile). Reports the stream's
median inter-token gap before the big request, the largest gap while it was in flight, and their
ratio (the target: at most 2), and as a control the largest gap in an equal window just before the
big request was sent (the stream alone: the gaps the machine makes without any big request). Every
token is an event of the stream (return_token_ids), so that a gap is a step's lateness, not text the
detokenizer held back. The sender opens its connection before the window starts, so that only the
sending is inside it; with `--sender-idle` it runs as SCHED_IDLE, on CPU nothing else wants, as a
client on another machine would (the kernel's work moving the bytes still counts). With several
--repo values the servers are measured alternately, round by round, so that a noisy machine affects
each the same way. Each round also says how much CPU time the hypervisor took from the machine (a VM's
steal time, /proc/stat) in the control second and in the request's window: on a VM, a step during
which the host runs something else for 10-40 ms is that much late, whatever the server does. Asserts
nothing.

With `--cpu`, no stream runs: each round sends the big request alone and reports the CPU time each
thread of the server process spent meanwhile (from /proc/<pid>/task/<tid>/schedstat: CPU time, not
wall time, so a busy machine changes it little), the event-loop thread apart, and that of its child
processes (the request workers). What the server's threads spend, they spend holding the interpreter
lock in pieces the engine thread waits behind; what the children spend does not touch it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
CONTROL_S = 1.0  # the control window: the stream alone, just before the big request is sent
FLAGS = ("--kv-cache-gib", "0.05", "--state-cache-gib", "0.05", "--max-request-bytes", str(64 << 20),
         "--log-level", "WARNING")


@dataclass
class Round:
    normal_gap_s: float  # median inter-token gap before the big request
    control_gap_s: float  # largest gap just before the big request (nothing else sent), in a window as long as the
    #   measured one (at most CONTROL_S): what the stream's gaps are without a big request
    max_gap_s: float  # largest gap between two tokens while the big request was in flight
    big_s: float  # the big request's response time
    big_status: int
    control_stolen_ms: float = 0.0  # time the hypervisor took from this VM's CPUs in the control second
    stolen_ms: float = 0.0  # the same while the big request was in flight (0 on bare metal)

    @property
    def ratio(self) -> float:
        return self.max_gap_s / self.normal_gap_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(repo: Path, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="stall-bench-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "cairn.cli", "serve", "--port", str(port), *FLAGS, *flags],
                            cwd=repo, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    return proc, wait_healthy(proc, url, f"server in {repo}", log.name)


def wait_healthy(proc: subprocess.Popen, url: str, what: str, log_name: str, timeout_s: float = 300) -> str:
    """url once its /health answers 200; else kill proc and raise, naming the log to read."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not start; see {log_name}")


def stream_times(url: str, times: list[float], stop: threading.Event) -> None:
    body = {"prompt": "a story", "max_tokens": 20000, "stream": True, "ignore_eos": True, "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
            if stop.is_set():
                return


SEND_BIG = """
import json, os, sys, time, httpx
url, mib, kind, idle = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "idle"
if idle:  # it runs only on a core nothing else wants: as if the client were another machine
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
text = "word " * ((mib << 20) // 5)
if kind == "chat":
    path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
else:
    path, body = "/v1/completions", {"prompt": text, "max_tokens": 1}
data = json.dumps(body).encode()
client = httpx.Client(timeout=600)  # (its TLS context takes tens of ms of CPU to build)
client.get(url + "/health")  # the connection is open and kept: the window holds the sending alone
print("ready", flush=True)
sys.stdin.readline()  # built before the measured window starts: only the sending is inside it
t0 = time.monotonic()
r = client.post(url + path, content=data, headers={"content-type": "application/json"})
print(r.status_code, time.monotonic() - t0)
"""


def stolen_ms() -> float:
    """Time the hypervisor has run something else on this VM's CPUs, all CPUs summed, in ms (10 ms
    ticks; /proc/stat's steal column, 0 on bare metal). A thread loses that time without any CPU time
    or run-queue wait of its own: a step during which 10-40 ms are stolen is that much late."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8]) * 1e3 / os.sysconf("SC_CLK_TCK")


def start_stream(url: str, warmup_tokens: int) -> tuple[list[float], threading.Event, threading.Thread]:
    """A stream read on a thread into its token times, returned once it has `warmup_tokens` of them; set
    the event to stop it."""
    times: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(target=stream_times, args=(url, times, stop), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while len(times) < warmup_tokens:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the stream did not start")
        time.sleep(0.01)
    return times, stop, thread


def one_round(url: str, mib: int, kind: str, warmup_tokens: int, sender_idle: bool) -> Round:
    """The big request is sent by another process, so that building and sending it does not slow
    down this process's reading of the stream; it is built, and its connection opened, before the
    measured window starts. Every token is an event of the stream (return_token_ids), so a gap is
    time without a step's output, not a character the detokenizer held back."""
    times, stop, thread = start_stream(url, warmup_tokens)
    sender = subprocess.Popen([sys.executable, "-c", SEND_BIG, url, str(mib), kind, "idle" if sender_idle else "-"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if sender.stdout.readline().strip() != "ready":
        raise RuntimeError("the sender did not start")
    control_t0, steal0 = time.monotonic(), stolen_ms()
    time.sleep(CONTROL_S)
    t0, steal1 = time.monotonic(), stolen_ms()
    out, _ = sender.communicate("go\n")
    t1 = time.monotonic()
    status, big_s = out.split()
    time.sleep(0.1)
    steal2 = stolen_ms()
    time.sleep(0.1)  # a few more tokens: a gap that ends after the answer counts too
    stop.set()
    thread.join(30)
    before = [t for t in times if t < t0]
    normal = statistics.median(b - a for a, b in zip(before[5:], before[6:], strict=False))
    control_t0 = max(control_t0, t0 - (t1 + 0.1 - t0))  # as long as the measured window (when it is shorter)
    return Round(normal, max_gap(times, control_t0, t0), max_gap(times, t0, t1 + 0.1), float(big_s), int(status),
                 steal1 - steal0, steal2 - steal1)


def max_gap(times: list[float], start: float, end: float) -> float:
    """The largest gap between two consecutive tokens of which one falls within [start, end]."""
    return max(b - a for a, b in zip(times, times[1:], strict=False) if b >= start and a <= end)


@dataclass
class CpuRound:
    event_loop_ms: float  # the server process's main thread (uvicorn's event loop)
    other_threads_ms: list[float]  # each other thread that ran (engine, pools, pickling helpers), largest first
    children_ms: float  # the server's child processes (request workers)
    status: int


def thread_cpu_ns(pid: int) -> dict[int, int]:
    cpu = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            cpu[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    return cpu


def children_cpu_ns(pid: int) -> dict[int, int]:
    kids = [int(k) for task in Path(f"/proc/{pid}/task").iterdir() for k in (task / "children").read_text().split()]
    return {k: sum(thread_cpu_ns(k).values()) for k in kids}


def cpu_round(pid: int, url: str, data: bytes) -> CpuRound:
    threads, kids = thread_cpu_ns(pid), children_cpu_ns(pid)
    r = httpx.post(url + "/v1/chat/completions", content=data, headers={"content-type": "application/json"},
                   timeout=600)
    time.sleep(0.3)  # (what the answer leaves to do)
    threads_after, kids_after = thread_cpu_ns(pid), children_cpu_ns(pid)
    spent = {t: (ns - threads.get(t, 0)) / 1e6 for t, ns in threads_after.items()}
    others = sorted((ms for t, ms in spent.items() if t != pid and ms >= 0.5), reverse=True)
    children = sum(ns - kids.get(k, 0) for k, ns in kids_after.items()) / 1e6
    return CpuRound(spent.get(pid, 0.0), others, children, r.status_code)


def cpu_main(servers: dict[Path, tuple[subprocess.Popen, str]], rounds: int, mib: int) -> None:
    text = "word " * ((mib << 20) // 5)
    data = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
    for _, url in servers.values():  # the request workers start (at the first large request, in older checkouts)
        httpx.post(url + "/v1/chat/completions", content=data, headers={"content-type": "application/json"},
                   timeout=600)
    print("| checkout | event-loop thread CPU (ms) | other server threads (ms) | request workers (ms) | status |")
    print("|---|---:|---|---:|---|")
    for _ in range(rounds):
        for repo, (proc, url) in servers.items():
            r = cpu_round(proc.pid, url, data)
            print(f"| {repo.name} | {r.event_loop_ms:.1f} | {', '.join(f'{ms:.1f}' for ms in r.other_threads_ms)} | "
                  f"{r.children_ms:.1f} | {r.status} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", action="append", type=Path, help="checkout(s) to serve from (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--big-mib", type=int, default=20)
    p.add_argument("--big-kind", choices=("chat", "completion"), default="chat")
    p.add_argument("--warmup-tokens", type=int, default=40)
    p.add_argument("--cpu", action="store_true", help="CPU per server thread for the big request alone (a chat)")
    p.add_argument("--out", type=Path, help="write the rounds as JSON here")
    p.add_argument("--server-flags", default="", help="more `cairn serve` flags, space-separated (e.g. a real "
                   "checkpoint: --model /tmp/cairn-checkpoint-0.8b --dtype bfloat16)")
    p.add_argument("--sender-idle", action="store_true",
                   help="send the big request from a SCHED_IDLE process: its CPU then competes with nothing, as "
                        "if the client were another machine (the kernel's work receiving it still counts)")
    ns = p.parse_args()
    repos = [repo.resolve() for repo in ns.repo or [REPO_ROOT]]
    servers = {repo: start(repo, ns.server_flags.split()) for repo in repos}
    results: dict[Path, list[Round]] = {repo: [] for repo in repos}
    try:
        if ns.cpu:
            return cpu_main(servers, ns.rounds, ns.big_mib) or 0
        for _ in range(ns.rounds):
            for repo, (_, url) in servers.items():
                results[repo].append(one_round(url, ns.big_mib, ns.big_kind, ns.warmup_tokens, ns.sender_idle))
                print(f"{repo}: {results[repo][-1]}", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    print(f"| checkout | normal gap (ms) | largest gap, same window alone before (ms) | largest gap while a "
          f"{ns.big_mib} MiB {ns.big_kind} request is in flight (ms) | ratio | big request (s, status) | "
          "stolen by the hypervisor: control second, request window (ms) |")
    print("|---|---|---|---|---|---|---|")
    for repo, rounds in results.items():
        for r in rounds:
            print(f"| {repo.name} | {r.normal_gap_s * 1e3:.1f} | {r.control_gap_s * 1e3:.1f} | "
                  f"{r.max_gap_s * 1e3:.1f} | {r.ratio:.1f} | {r.big_s:.2f}, {r.big_status} | "
                  f"{r.control_stolen_ms:.0f}, {r.stolen_ms:.0f} |")
    for repo, rounds in results.items():
        print(f"\n{repo.name}: median ratio {statistics.median(r.ratio for r in rounds):.1f}, "
              f"largest gap median {statistics.median(r.max_gap_s for r in rounds) * 1e3:.1f} ms, "
              f"control median {statistics.median(r.control_gap_s for r in rounds) * 1e3:.1f} ms "
              f"(ratio {statistics.median(r.control_gap_s / r.normal_gap_s for r in rounds):.1f}); rounds over 2x: "
              f"{sum(r.ratio > 2 for r in rounds)} of {len(rounds)}, of which with time stolen in the request window: "
              f"{sum(r.ratio > 2 and r.stolen_ms > 0 for r in rounds)}")
    print(f"\nCPU: {os.cpu_count()} cores; command: python benchmarks/stall_bench.py "
          + " ".join(sys.argv[1:]))
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps({"command": sys.argv, "cpu_count": os.cpu_count(), "sender_idle": ns.sender_idle,
                                      "rounds": {str(repo): [asdict(r) for r in rounds]
                                                 for repo, rounds in results.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
