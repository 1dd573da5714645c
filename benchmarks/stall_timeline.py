"""Where a running stream loses time while a huge request arrives: a timeline of the server, by phase.

    python benchmarks/stall_timeline.py                        # this checkout, 5 rounds
    python benchmarks/stall_timeline.py --server-flags=--body-read-mib-per-s=0 --rounds 5

The rounds are stall_bench's (a streamed completion, then one 20 MiB chat in its own process, with a
control window before it), against a `cairn serve` started from this file, which records in the
server process, on the machine's monotonic clock:
- each engine step (`EngineBridge._step`): start, end, the engine thread's CPU time;
- each `data_received` call of uvicorn's h11 protocol (the event loop receiving the body);
- each request-worker job (`_Worker.run`: from the first chunk written to the answer).
For each round it prints the phases of the big request (receiving its body, the worker preparing it)
and the largest token gap in each; then, over all rounds, the median engine-step duration in each
phase against the control window's (the stream alone). A phase that slows the engine shows a ratio
above 1; the noise of the machine shows in the control. A diagnostic: it patches the server's
internals (a wrapper, nothing in cairn changes), asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stall_bench  # noqa: E402  (the rounds, the server flags, the sender)

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACE_ENV = "STALL_TIMELINE_OUT"  # where the traced server writes its events at exit


def traced_serve(argv: list[str]) -> int:
    """`cairn serve argv`, recording steps, receives and worker jobs; writes them as JSON at exit."""
    from uvicorn.protocols.http import h11_impl

    from cairn import cli
    from cairn.server import bridge, workers

    events: list[dict] = []

    def timed(kind: str, fn):
        def wrapper(*args):
            t0_s, cpu0_s = time.monotonic(), time.thread_time()
            try:
                return fn(*args)
            finally:
                events.append({"kind": kind, "t0": t0_s, "t1": time.monotonic(),
                               "cpu_s": time.thread_time() - cpu0_s})
        return wrapper

    bridge.EngineBridge._step = timed("step", bridge.EngineBridge._step)
    h11_impl.H11Protocol.data_received = timed("recv", h11_impl.H11Protocol.data_received)
    workers._Worker.run = timed("worker", workers._Worker.run)
    try:
        return cli.main(["serve", *argv])
    finally:
        Path(os.environ[TRACE_ENV]).write_text(json.dumps(events))


def start_traced(flags: list[str], trace: Path) -> tuple[subprocess.Popen, str]:
    port = stall_bench.free_port()
    env = {**os.environ, TRACE_ENV: str(trace), "PYTHONPATH": str(REPO_ROOT)}
    log = tempfile.NamedTemporaryFile(prefix="stall-timeline-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port), *stall_bench.FLAGS, *flags],
                            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, stall_bench.wait_healthy(proc, f"http://127.0.0.1:{port}", "the traced server", log.name)


def one_round(url: str, sender_idle: bool) -> dict:
    """stall_bench's round, keeping the token times and the window edges."""
    times: list[float] = []
    stop = threading.Event()
    reader = threading.Thread(target=stall_bench.stream_times, args=(url, times, stop), daemon=True)
    reader.start()
    while len(times) < 40:
        time.sleep(0.01)
    sender = subprocess.Popen([sys.executable, "-c", stall_bench.SEND_BIG, url, "20", "chat",
                               "idle" if sender_idle else "-"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if sender.stdout.readline().strip() != "ready":
        raise RuntimeError("the sender did not start")
    control_s = time.monotonic()
    time.sleep(stall_bench.CONTROL_S)
    t0 = time.monotonic()
    sender.communicate("go\n")
    t1 = time.monotonic()
    time.sleep(0.2)
    stop.set()
    reader.join(30)
    return {"times": times, "control": (control_s, t0), "t0": t0, "t1": t1}


def step_durations(events: list[dict], start: float, end: float) -> list[float]:
    """Durations of the steps that overlap [start, end]."""
    return [e["t1"] - e["t0"] for e in events if e["kind"] == "step" and e["t1"] >= start and e["t0"] <= end]


def phases(events: list[dict], r: dict) -> dict[str, tuple[float, float]]:
    """The round's windows: the control, the body being received, the worker job."""
    t0, t1 = r["t0"], r["t1"]
    recv = [e for e in events if e["kind"] == "recv" and t0 <= e["t0"] <= t1]
    job = [e for e in events if e["kind"] == "worker" and t0 <= e["t0"] <= t1]
    out = {"control": r["control"]}
    if recv:
        out["receive"] = (recv[0]["t0"], recv[-1]["t1"])
    if job:
        out["worker"] = (job[0]["t0"], job[0]["t1"])
    return out


def report(events: list[dict], rounds: list[dict]) -> None:
    by_phase: dict[str, list[float]] = {}
    for i, r in enumerate(rounds):
        spans = phases(events, r)
        recv_ms = sum((e["t1"] - e["t0"]) * 1e3 for e in events
                      if e["kind"] == "recv" and r["t0"] <= e["t0"] <= r["t1"])
        parts = [f"{name} {(b - a) * 1e3:.0f} ms (largest gap {stall_bench.max_gap(r['times'], a, b) * 1e3:.1f})"
                 for name, (a, b) in spans.items()]
        print(f"round {i + 1}: " + "; ".join(parts) + f"; in data_received {recv_ms:.1f} ms")
        for name, (a, b) in spans.items():
            by_phase.setdefault(name, []).extend(step_durations(events, a, b))
    control = statistics.median(by_phase["control"])
    print("\n| phase | steps | median step (ms) | against the control |\n|---|---:|---:|---:|")
    for name, durations in by_phase.items():
        median = statistics.median(durations)
        print(f"| {name} | {len(durations)} | {median * 1e3:.1f} | {median / control:.2f}x |")


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return traced_serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--server-flags", default="", help="more `cairn serve` flags, space-separated")
    p.add_argument("--sender-idle", action="store_true", help="send the big request from a SCHED_IDLE process")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "events.json"
        proc, url = start_traced(ns.server_flags.split(), trace)
        try:
            rounds = [one_round(url, ns.sender_idle) for _ in range(ns.rounds)]
        finally:
            proc.terminate()
            proc.wait(60)
        report(json.loads(trace.read_text()), rounds)
    print(f"\nCPU: {os.cpu_count()} cores; command: python benchmarks/stall_timeline.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
