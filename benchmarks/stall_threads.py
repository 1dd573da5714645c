"""Each traced engine step split by server thread and by engine part: stall_timeline's `--threads` and `--cpu-probe`.

In the traced server: `schedstat` reads every thread's CPU time and run-queue wait, `time_parts` times the
engine's parts (model call, scheduling, sampling, appending). In the benchmark process: `report_threads`
compares the slow steps (over 1.5x the median) with the usual ones, part by part, with the CPU probe's
cost per piece of work (`start_cpu_probe`: a SCHED_IDLE process) during each step. A diagnostic; it
asserts nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def schedstat() -> dict[str, tuple[int, int]]:
    """Per thread of this process (by name and id): CPU time and time spent runnable but waiting for a
    core (the run queue), in ns, from /proc/self/task/<tid>/schedstat."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                cpu, wait = f.read().split()[:2]
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[f"{name}/{task}"] = (int(cpu), int(wait))
    return out


def time_parts(parts: dict[str, float]) -> None:
    """Add to `parts` the wall time (ms) of the engine's model call, scheduling, bookkeeping after the
    step, sampling and appending, each time they run."""
    from cairn import runner, scheduler
    from cairn.engine import engine

    def timer(name: str, fn):
        def wrapper(*args, **kwargs):
            t0_s = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + (time.monotonic() - t0_s) * 1e3
        return wrapper

    runner.ModelRunner.run = timer("model", runner.ModelRunner.run)
    scheduler.Scheduler.schedule = timer("schedule", scheduler.Scheduler.schedule)
    scheduler.Scheduler.after_step = timer("after_step", scheduler.Scheduler.after_step)
    engine.sample_isolated = timer("sample", engine.sample_isolated)
    engine.Engine._append = timer("append", engine.Engine._append)


CPU_PROBE = """
import json, os, sys, time
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # runs only on a core nothing else wants
out, samples = sys.argv[1], []
while not os.path.exists(out + ".stop"):
    t0, c0 = time.monotonic(), time.thread_time()
    sum(range(20000))  # a fixed piece of work: its CPU time is how fast the core runs now
    samples.append((t0, time.thread_time() - c0))
    time.sleep(0.002)
with open(out, "w") as f:
    json.dump(samples, f)
"""


def start_cpu_probe(out: Path) -> subprocess.Popen:
    """A SCHED_IDLE process timing a fixed piece of work (CPU time) every ~2 ms on whatever core is free:
    if the server's steps take more CPU time while the probe's work does too, the machine (the host
    under this VM, another guest) slowed every core, not the server."""
    return subprocess.Popen([sys.executable, "-c", CPU_PROBE, str(out)])


def stop_cpu_probe(proc: subprocess.Popen, out: Path) -> list[tuple[float, float]]:
    Path(str(out) + ".stop").touch()
    proc.wait(30)
    return json.loads(out.read_text())


def probe_cost(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """The probe's median CPU time (ms) per piece of work in [start, end], None without a sample there."""
    costs = [c for t, c in samples if start <= t <= end]
    return statistics.median(costs) * 1e3 if costs else None


def _label(key: str, engine_tid: int, pid: int) -> str:
    name, tid = key.rsplit("/", 1)
    if int(tid) == engine_tid:
        return "engine"
    return "loop" if int(tid) == pid else f"{name}/{tid}"


def step_parts(e: dict, pid: int) -> dict[str, float]:
    """A traced step's wall time split (ms): the engine thread's CPU, its run-queue wait, the rest
    (asleep: the interpreter lock, a torch barrier); and each other thread's CPU and wait meanwhile."""
    threads = {_label(k, e["engine_tid"], pid): v for k, v in e["threads"].items()}
    cpu, wait = threads.pop("engine", (0.0, 0.0))
    wall = (e["t1"] - e["t0"]) * 1e3
    parts = {"wall": wall, "cpu": cpu, "wait": wait, "asleep": wall - cpu - wait, **e.get("parts", {})}
    for name, (c, w) in threads.items():
        parts[f"{name} cpu"], parts[f"{name} wait"] = c, w
    return parts


def report_threads(events: list[dict], times: list[float], pid: int,
                   probe: list[tuple[float, float]] | None = None) -> None:
    """Where the slow steps' time went, against the usual ones: the mean of each part (ms); with the CPU
    probe's samples, its cost per piece of work during each step ("probe", ms)."""
    steps = [e for e in events if e["kind"] == "step" and "threads" in e and times[0] <= e["t0"] <= times[-1]]
    if not steps:
        return
    for e in steps:
        cost = probe_cost(probe or [], e["t0"], e["t1"])
        if cost is not None:
            e.setdefault("parts", {})["probe"] = cost
    median = statistics.median(e["t1"] - e["t0"] for e in steps)
    slow = [step_parts(e, pid) for e in steps if e["t1"] - e["t0"] > 1.5 * median]
    usual = [step_parts(e, pid) for e in steps if e["t1"] - e["t0"] <= 1.5 * median]
    names = sorted({k for p in slow + usual for k in p}, key=lambda k: (k not in ("wall", "cpu", "wait", "asleep"), k))
    print(f"\n| step part, mean (ms) | usual steps (<= 1.5x median, n={len(usual)}) | slow steps (n={len(slow)}) |")
    print("|---|---:|---:|")
    for k in names:
        mean = [statistics.fmean(p.get(k, 0.0) for p in group) if group else 0.0 for group in (usual, slow)]
        if max(mean) >= 0.05:
            print(f"| {k} | {mean[0]:.2f} | {mean[1]:.2f} |")
    print("\nthe 8 slowest steps (ms):")
    for e in sorted(steps, key=lambda e: e["t0"] - e["t1"])[:8]:
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in step_parts(e, pid).items() if abs(v) >= 0.1))
