"""Where a running stream loses time while a huge request arrives: a timeline of the server, by phase.

    python benchmarks/stall_timeline.py                        # this checkout, 5 rounds
    python benchmarks/stall_timeline.py --server-flags=--body-read-mib-per-s=0 --rounds 5
    python benchmarks/stall_timeline.py --stream-only 20          # no big request: where the stream's gaps come from
    python benchmarks/stall_timeline.py --stream-only 20 --repo /tmp/cairn-before   # another checkout's server
    python benchmarks/stall_timeline.py --switch-interval-ms 1 --read-kib 256   # the server's GIL switch, read size
    python benchmarks/stall_timeline.py --stream-only 20 --threads --cpu-probe   # each step split by thread and part

The rounds are stall_bench's (a streamed completion, then one 20 MiB chat in its own process, with a
control window before it), against a `cairn serve` started from this file, which records in the
server process, on the machine's monotonic clock:
- each engine step (`EngineBridge._step`): start, end, the engine thread's CPU time;
- each `data_received` call of cairn's HTTP protocol (`connections.GuardedH11Protocol`: the event
  loop receiving the body), with the loop thread's CPU time;
- each request-worker job (`_Worker.run`: from the first chunk written to the answer);
- each garbage collection (`gc.callbacks`: generation, duration, thread);
- the hand-off of each step's outputs: posted by the engine thread (`EngineBridge._deliver`), put on
  the request's queue by the event loop (`_put_all`), written to the socket (the h11 cycle's `send`).
With `--stream-only SECONDS` no big request is sent: one stream runs alone, and the table says how
long each hop from a step's end to the client takes (median / p99 / largest), how long the steps and
the collections take, and what coincided with the largest gaps. `--switch-interval-ms` sets the
traced server's `sys.setswitchinterval`, `--read-kib` its socket read size for a body received past h11.
With `--stream-only --threads`, each step also records what every thread of the server did during it
(CPU time and run-queue wait, from /proc/self/task/*/schedstat) and how long the engine's parts took
(the model call, scheduling, sampling, appending), and the engine thread's user and system CPU time,
page faults and involuntary context switches (getrusage), and the time the hypervisor took from this
VM's CPUs (/proc/stat's steal, in 10 ms ticks); the report compares the slow steps (over 1.5x the
median) with the usual ones: a slow step's extra time is the engine thread's CPU (more work, or a
slower core), its run-queue wait (no core free), or sleep (the interpreter lock; a torch barrier
waiting for its worker thread). `--cpu-probe` adds a SCHED_IDLE process timing a fixed piece of work
meanwhile: whether the whole machine ran slower at the slow steps (both in stall_threads.py).
`--keep-trace` keeps the events.
For each round it prints the phases of the big request (receiving its body, the worker preparing it)
and the largest token gap in each; then, over all rounds, the median engine-step duration in each
phase against the control window's (the stream alone), in wall time and in the engine thread's CPU
time (a wall-time ratio above the CPU-time one is time the engine thread waited: the interpreter lock,
a core). A phase that slows the engine shows a ratio
above 1; the noise of the machine shows in the control. A diagnostic: it patches the server's
internals (a wrapper, nothing in cairn changes), asserts nothing.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stall_bench  # noqa: E402  (the rounds, the server flags, the sender)
import stall_threads  # noqa: E402  (--threads: each step split by thread and part; --cpu-probe)

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACE_ENV = "STALL_TIMELINE_OUT"  # where the traced server writes its events at exit
SWITCH_ENV = "STALL_TIMELINE_SWITCH_MS"  # the traced server's sys.setswitchinterval, in ms
READ_ENV = "STALL_TIMELINE_READ_KIB"  # its socket read size for a body received past h11, in KiB
THREADS_ENV = "STALL_TIMELINE_THREADS"  # set: each step also records every thread's scheduler accounting


def traced_serve(argv: list[str]) -> int:
    """`cairn serve argv`, recording steps, receives and worker jobs; writes them as JSON at exit."""
    from uvicorn.protocols.http import h11_impl

    from cairn import cli
    from cairn.server.engine_io import bridge, workers
    from cairn.server.http import connections

    events: list[dict] = []

    parts: dict[str, float] = {}  # this step's time in each timed part of the engine (ms), engine thread only

    def timed_step(kind: str, step):
        """The step, plus what each thread of the process did during it: CPU and run-queue wait (ms).
        A step whose wall time exceeds the engine thread's CPU and run-queue wait slept: on the
        interpreter lock, or in a torch barrier (a barrier's spinning counts as CPU)."""
        def wrapper(*args):
            parts.clear()
            usage0, steal0 = resource.getrusage(resource.RUSAGE_THREAD), stall_bench.stolen_ms()
            before, t0_s, cpu0_s = stall_threads.schedstat(), time.monotonic(), time.thread_time()
            try:
                return step(*args)
            finally:
                t1_s, cpu_s, after = time.monotonic(), time.thread_time() - cpu0_s, stall_threads.schedstat()
                usage = resource.getrusage(resource.RUSAGE_THREAD)
                parts.update({"user": (usage.ru_utime - usage0.ru_utime) * 1e3,
                              "system": (usage.ru_stime - usage0.ru_stime) * 1e3,
                              "page faults": usage.ru_minflt - usage0.ru_minflt + usage.ru_majflt - usage0.ru_majflt,
                              "involuntary switches": usage.ru_nivcsw - usage0.ru_nivcsw,
                              "stolen (10 ms ticks)": stall_bench.stolen_ms() - steal0})
                threads = {k: ((c - before[k][0]) / 1e6, (w - before[k][1]) / 1e6)
                           for k, (c, w) in after.items() if k in before and (c - before[k][0] or w - before[k][1])}
                events.append({"kind": kind, "t0": t0_s, "t1": t1_s, "cpu_s": cpu_s, "threads": threads,
                               "engine_tid": threading.get_native_id(), "parts": dict(parts)})
        return wrapper

    def timed(kind: str, fn):
        def wrapper(*args):
            t0_s, cpu0_s = time.monotonic(), time.thread_time()
            try:
                return fn(*args)
            finally:
                events.append({"kind": kind, "t0": t0_s, "t1": time.monotonic(),
                               "cpu_s": time.thread_time() - cpu0_s})
        return wrapper

    step_timer = timed_step if os.environ.get(THREADS_ENV) else timed
    if os.environ.get(THREADS_ENV):
        stall_threads.time_parts(parts)
    bridge.EngineBridge._step = step_timer("step", bridge.EngineBridge._step)
    trace_hand_off(events, bridge, h11_impl)
    gc.callbacks.append(gc_tracer(events))
    protocol = connections.GuardedH11Protocol  # (whose data_received may take a large body past h11's)
    protocol.data_received = timed("recv", protocol.data_received)
    workers._Worker.run = timed("worker", workers._Worker.run)
    if os.environ.get(SWITCH_ENV):
        sys.setswitchinterval(float(os.environ[SWITCH_ENV]) / 1e3)
    if os.environ.get(READ_ENV) and hasattr(connections, "DIRECT_READ_BYTES"):
        connections.DIRECT_READ_BYTES = int(os.environ[READ_ENV]) << 10
    try:
        return cli.main(["serve", *argv])
    finally:
        Path(os.environ[TRACE_ENV]).write_text(json.dumps(events))


def trace_hand_off(events: list[dict], bridge, h11_impl) -> None:
    """Record when each step's outputs are posted, put on their queues, and written (one event each)."""
    deliver, put_all, send = bridge.EngineBridge._deliver, bridge._put_all, h11_impl.RequestResponseCycle.send

    def traced_deliver(self, outputs):
        events.append({"kind": "post", "t0": time.monotonic()})
        return deliver(self, outputs)

    def traced_put_all(items):
        events.append({"kind": "put", "t0": time.monotonic()})
        return put_all(items)

    async def traced_send(self, message):
        if message.get("type") == "http.response.body" and message.get("body"):
            events.append({"kind": "write", "t0": time.monotonic()})
        return await send(self, message)

    bridge.EngineBridge._deliver, bridge._put_all = traced_deliver, traced_put_all
    h11_impl.RequestResponseCycle.send = traced_send


def gc_tracer(events: list[dict]):
    started: dict[str, float] = {}

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started["t0"] = time.monotonic()
        else:
            events.append({"kind": f"gc{info['generation']}", "t0": started["t0"], "t1": time.monotonic(),
                           "thread": threading.current_thread().name})
    return callback


def start_traced(flags: list[str], trace: Path, repo: Path = REPO_ROOT, switch_ms: float | None = None,
                 read_kib: int | None = None, threads: bool = False) -> tuple[subprocess.Popen, str]:
    port = stall_bench.free_port()
    env = {**os.environ, TRACE_ENV: str(trace), "PYTHONPATH": str(repo)}
    if switch_ms is not None:
        env[SWITCH_ENV] = str(switch_ms)
    if read_kib is not None:
        env[READ_ENV] = str(read_kib)
    if threads:
        env[THREADS_ENV] = "1"
    log = tempfile.NamedTemporaryFile(prefix="stall-timeline-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port), *stall_bench.FLAGS, *flags],
                            cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, stall_bench.wait_healthy(proc, f"http://127.0.0.1:{port}", "the traced server", log.name)


def one_round(url: str, sender_idle: bool) -> dict:
    """stall_bench's round, keeping the token times and the window edges."""
    times, stop, reader = stall_bench.start_stream(url, 40)
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


def step_durations(events: list[dict], start: float, end: float, what: str = "wall") -> list[float]:
    """Durations (wall time, or with what="cpu_s" the engine thread's CPU time) of the steps overlapping
    [start, end]."""
    return [e["t1"] - e["t0"] if what == "wall" else e[what] for e in events
            if e["kind"] == "step" and e["t1"] >= start and e["t0"] <= end]


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
    cpu_by_phase: dict[str, list[float]] = {}
    for i, r in enumerate(rounds):
        spans = phases(events, r)
        recvs = [e for e in events if e["kind"] == "recv" and r["t0"] <= e["t0"] <= r["t1"]]
        recv_ms = sum((e["t1"] - e["t0"]) * 1e3 for e in recvs)
        recv_cpu_ms = sum(e["cpu_s"] * 1e3 for e in recvs)
        parts = [f"{name} {(b - a) * 1e3:.0f} ms (largest gap {stall_bench.max_gap(r['times'], a, b) * 1e3:.1f})"
                 for name, (a, b) in spans.items()]
        collections = [f"{e['kind']} {(e['t1'] - e['t0']) * 1e3:.1f} ms" for e in events
                       if e["kind"].startswith("gc") and e["kind"] != "gc0" and r["t0"] <= e["t0"] <= r["t1"]]
        print(f"round {i + 1}: " + "; ".join(parts) + f"; in data_received {recv_ms:.1f} ms "
              f"({recv_cpu_ms:.1f} ms CPU, {len(recvs)} calls); "
              f"collections (gen 1-2) {', '.join(collections) or 'none'}")
        for name, (a, b) in spans.items():
            by_phase.setdefault(name, []).extend(step_durations(events, a, b))
            cpu_by_phase.setdefault(name, []).extend(step_durations(events, a, b, "cpu_s"))
    control = statistics.median(by_phase["control"])
    cpu_control = statistics.median(cpu_by_phase["control"])
    print("\n| phase | steps | median step (ms) | against the control | median step CPU (ms) | against the control |"
          "\n|---|---:|---:|---:|---:|---:|")
    for name, durations in by_phase.items():
        median, cpu = statistics.median(durations), statistics.median(cpu_by_phase[name])
        print(f"| {name} | {len(durations)} | {median * 1e3:.1f} | {median / control:.2f}x | {cpu * 1e3:.1f} | "
              f"{cpu / cpu_control:.2f}x |")


def stream_alone(url: str, seconds: float) -> list[float]:
    """The token times of one stream running alone for `seconds` (after its first 40 tokens)."""
    times, stop, reader = stall_bench.start_stream(url, 40)
    start = times[-1]
    time.sleep(seconds)
    stop.set()
    reader.join(30)
    return [t for t in times if t >= start]


def next_after(later: list[float], earlier: list[float]) -> list[float]:
    """For each time in `earlier`, how long until the first time in `later` at or after it."""
    out = []
    for t in earlier:
        i = bisect.bisect_left(later, t)
        if i < len(later):
            out.append(later[i] - t)
    return out


def _row(name: str, values_s: list[float]) -> str:
    if not values_s:
        return f"| {name} | 0 | - | - | - |"
    ms = sorted(v * 1e3 for v in values_s)
    return (f"| {name} | {len(ms)} | {statistics.median(ms):.2f} | {ms[min(len(ms) - 1, int(0.99 * len(ms)))]:.2f} "
            f"| {ms[-1]:.2f} |")


def report_stream(events: list[dict], times: list[float]) -> None:
    """Where the stream's gaps come from: each hop from a step's end to the client, the steps, the collections."""
    start, end = times[0], times[-1]
    at = {k: sorted(e["t0"] for e in events if e["kind"] == k and start <= e["t0"] <= end)
          for k in ("post", "put", "write")}
    steps = [e for e in events if e["kind"] == "step" and start <= e["t0"] <= end]
    collections = [e for e in events if e["kind"].startswith("gc") and start <= e["t0"] <= end]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    print(f"| over {end - start:.1f} s of one stream alone | n | median (ms) | p99 (ms) | largest (ms) |")
    print("|---|---:|---:|---:|---:|")
    print(_row("gap between two tokens, as the client reads them", gaps))
    print(_row("engine step", [e["t1"] - e["t0"] for e in steps]))
    print(_row("engine step, the engine thread's CPU time", [e["cpu_s"] for e in steps]))
    print(_row("outputs posted -> put on the request's queue (event loop)", next_after(at["put"], at["post"])))
    print(_row("put on the queue -> written to the socket", next_after(at["write"], at["put"])))
    print(_row("written -> read by the client", next_after(times, at["write"])))
    for generation in range(3):
        print(_row(f"garbage collection, generation {generation}",
                   [e["t1"] - e["t0"] for e in collections if e["kind"] == f"gc{generation}"]))
    print("\nthe 5 largest gaps, and what overlapped them:")
    for a, b in sorted(zip(times, times[1:], strict=False), key=lambda ab: ab[0] - ab[1])[:5]:
        overlapping = [f"{e['kind']} {(e['t1'] - e['t0']) * 1e3:.1f} ms on {e['thread']}" for e in collections
                       if e["t0"] < b and e["t1"] > a]
        inside = [e for e in steps if e["t0"] < b and e["t1"] > a]
        longest = max((e["t1"] - e["t0"] for e in inside), default=0.0)
        stolen = sum(e.get("parts", {}).get("stolen (10 ms ticks)", 0.0) for e in inside)
        print(f"  {(b - a) * 1e3:.1f} ms at +{a - start:.2f} s: longest step {longest * 1e3:.1f} ms; "
              + ("; ".join(overlapping) or "no collection")
              + (f"; stolen by the hypervisor {stolen:.0f} ms" if any("parts" in e for e in inside) else ""))


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return traced_serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--server-flags", default="", help="more `cairn serve` flags, space-separated")
    p.add_argument("--sender-idle", action="store_true", help="send the big request from a SCHED_IDLE process")
    p.add_argument("--stream-only", type=float, metavar="SECONDS",
                   help="send no big request: time one stream alone for SECONDS, hop by hop")
    p.add_argument("--repo", type=Path, default=REPO_ROOT, help="the checkout to serve from (default: this one)")
    p.add_argument("--switch-interval-ms", type=float, help="the server's sys.setswitchinterval (default: 5 ms)")
    p.add_argument("--threads", action="store_true", help="with --stream-only: split each step's time by "
                   "thread (CPU, run-queue wait) from /proc schedstat, and report where the slow steps' went")
    p.add_argument("--cpu-probe", action="store_true", help="with --stream-only --threads: time a fixed piece "
                   "of work in a SCHED_IDLE process meanwhile (does the whole machine slow down at the slow steps?)")
    p.add_argument("--keep-trace", type=Path, help="also write the server's events (JSON) here")
    p.add_argument("--read-kib", type=int, help="the server's socket read size for a body received past h11 "
                                                "(connections.DIRECT_READ_BYTES; checkouts that have it)")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "events.json"
        proc, url = start_traced(ns.server_flags.split(), trace, ns.repo.resolve(), ns.switch_interval_ms,
                                 ns.read_kib, ns.threads)
        try:
            if ns.stream_only:
                probe_proc = stall_threads.start_cpu_probe(Path(d) / "probe.json") if ns.cpu_probe else None
                times = stream_alone(url, ns.stream_only)
                probe = stall_threads.stop_cpu_probe(probe_proc, Path(d) / "probe.json") if probe_proc else None
            else:
                rounds = [one_round(url, ns.sender_idle) for _ in range(ns.rounds)]
        finally:
            proc.terminate()
            proc.wait(60)
        if ns.stream_only:
            events = json.loads(trace.read_text())
            if ns.keep_trace:
                ns.keep_trace.write_text(json.dumps({"events": events, "times": times, "pid": proc.pid,
                                                     "probe": probe}))
            report_stream(events, times)
            stall_threads.report_threads(events, times, proc.pid, probe)
        else:
            report(json.loads(trace.read_text()), rounds)
    print(f"\nCPU: {os.cpu_count()} cores; command: python benchmarks/stall_timeline.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
