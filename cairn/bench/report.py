"""Markdown tables of a benchmark record: per request, per workload and policy, the replay, the targets.

What it is: pure formatting of `BenchRecord` / `WorkloadResult` into markdown (printed by the CLI and
written to `report.md` beside the JSON record).

What it is not: the numbers' source (record.py) or the plots (plots.py).
"""

from __future__ import annotations

from cairn.bench.policies import LABELS
from cairn.bench.record import REPLAY_LABEL, BenchRecord, WorkloadResult, replay_warm_over_cold


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _label(policy: str) -> str:
    return LABELS.get(policy, policy)


def requests_table(result: WorkloadResult) -> str:
    """One row per request: prompt, cached, computed, oracle, resume point and tier, time to first token."""
    lines = [f"{result.workload} / {_label(result.policy)}", "",
             "| # | request | prompt | cached | computed | oracle | resume at | tier | source | miss | TTFT s |",
             "|---:|---|---:|---:|---:|---:|---:|---|---|---|---:|"]
    for x in result.requests:
        lines.append(f"| {x.index} | {x.label} | {x.prompt_tokens} | {x.cached_tokens} | {x.computed_tokens} | "
                     f"{x.oracle_tokens} | {x.resume_position} | {x.resume_tier or '-'} | {x.resume_source or '-'} | "
                     f"{x.miss_reason or '-'} | {x.ttft_s:.3f} |")
    t = result.totals()
    lines.append(f"| | **total** | {t['prompt_tokens']} | {t['cached_tokens']} | {t['computed_tokens']} | "
                 f"{t['oracle_tokens']} | | | | | {t['ttft_total_s']:.3f} |")
    return "\n".join(lines)


def _grid(results: list[WorkloadResult]) -> tuple[list[str], list[str], dict]:
    workloads = list(dict.fromkeys(r.workload for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    return workloads, policies, {(r.workload, r.policy): r for r in results}


def summary_table(results: list[WorkloadResult]) -> str:
    """Reused / oracle and total time to first token, one row per workload, one column per policy."""
    workloads, policies, cell = _grid(results)
    lines = ["| workload | requests | prompt tokens | oracle tokens | " + " | ".join(map(_label, policies)) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(policies)]
    for w in workloads:
        first = cell[(w, policies[0])]  # (a workload is skipped under every policy or none: the runner decides)
        if first.skipped:
            lines.append(f"| {w} | - | - | - | " + " | ".join(["skipped"] * len(policies)) + " |")
            continue
        t = first.totals()
        cells = []
        for p in policies:
            rt = cell[(w, p)].totals()
            cells.append(f"{_pct(rt['reuse_of_oracle'])} · {rt['ttft_total_s']:.2f} s")
        lines.append(f"| {w} | {t['num_requests']} | {t['prompt_tokens']:,} | {t['oracle_tokens']:,} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def replay_table(results: list[WorkloadResult]) -> str:
    """The compaction replay under each policy: where it resumed, what it computed, TTFT, warm / cold."""
    runs = [r for r in results if r.workload == "compaction" and r.requests]
    if not runs:
        return ""
    lines = ["| policy | replay prompt | resumed at | source | computed | TTFT s | TTFT / no cache |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for r in runs:
        x = next(q for q in r.requests if q.label == REPLAY_LABEL)
        lines.append(f"| {_label(r.policy)} | {x.prompt_tokens} | {x.resume_position} | {x.resume_source or '-'} | "
                     f"{x.computed_tokens} | {x.ttft_s:.3f} | {_pct(replay_warm_over_cold(results, r.policy))} |")
    return "\n".join(lines)


def targets_table(record: BenchRecord) -> str:
    lines = ["| target | policy | value | required | met |", "|---|---|---:|---:|---|"]
    for t in record.targets:
        met = {True: "yes", False: "**no**", None: "n/a"}[t.met]
        note = f" ({t.note})" if t.note and t.met is not False else ""
        lines.append(f"| {t.name} | {_label(t.policy)} | {_pct(t.value)} | {t.comparison} {_pct(t.threshold)} | "
                     f"{met}{note} |")
    missed = [f"- {t.name}: missed: {t.note}" for t in record.targets if t.met is False]
    return "\n".join(lines + ([""] + missed if missed else []))


def report(record: BenchRecord) -> str:
    """The whole run: set-up, summary, replay, targets."""
    cfg = record.engine_config
    mem, cache, sched = cfg.get("memory", {}), cfg.get("cache", {}), cfg.get("scheduler", {})
    setup = (f"model `{record.model}` (size {record.size}), preset `{record.preset}`, seed {record.seed}, "
             f"target {record.target}")
    if cfg:
        gib = lambda x: "auto" if x is None else f"{x:g}"  # None: sized at start-up (cairn.engine.sizing)
        setup += (f"; KV pool {gib(mem.get('kv_cache_gib'))} GiB, snapshot budget "
                  f"{gib(cache.get('device_snapshot_gib'))} GiB, host tier {gib(cache.get('host_cache_gib'))} GiB, "
                  f"snapshot interval {cache.get('snapshot_interval')}, chunk {sched.get('max_num_batched_tokens')} "
                  f"tokens, page {mem.get('page_size')}, llama.cpp-style gap {record.min_gap_tokens}")
    env = record.environment
    setup += f"; torch {env.get('torch')}, {env.get('threads')} threads, {env.get('device')}, commit {env.get('git')}"
    parts = [setup, "", "Reused / oracle · total time to first token over the workload:", "",
             summary_table(record.results)]
    replay = replay_table(record.results)
    if replay:
        parts += ["", "Compaction replay:", "", replay]
    parts += ["", "Targets:", "", targets_table(record)]
    skipped = {r.workload: r.skipped for r in record.results if r.skipped}
    parts += [""] + [f"- {w}: skipped: {why}" for w, why in skipped.items()]
    return "\n".join(parts).rstrip() + "\n"
