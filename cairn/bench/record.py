"""The benchmark's record: per-request rows, per-workload results, the targets, and the JSON file.

What it is: the dataclasses that the runners fill and the report and plots read, their totals, and
the evaluation of the issue's targets. `BenchRecord.to_json()` is the JSON record's schema
(`cairn-bench/1`): every field below appears under its own name, and each result also carries its
`totals` (see `WorkloadResult.totals`).

What it is not: a runner or a formatter.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = "cairn-bench/1"
REPLAY_LABEL = "replay"  # the compaction workload's request whose warm/cold time to first token is a target


@dataclass
class RequestRecord:
    """One request as served: what the cache did and what it could have done."""

    index: int  # position in the workload's stream, from 0
    label: str  # the workload's name for it ("turn 7", "replay", ...)
    conversation: str  # the conversation it belongs to
    prompt_tokens: int  # tokens in the rendered prompt
    cached_tokens: int  # prompt tokens resumed from the cache
    computed_tokens: int  # prompt tokens prefilled: prompt_tokens - cached_tokens
    oracle_tokens: int  # what an unlimited cache could have reused (oracle.py)
    resume_position: int  # where the request resumed; 0 = cold
    resume_tier: str | None  # tier of the snapshot it resumed from
    resume_source: str | None  # placement rule that made that snapshot
    match_length: int  # longest common prefix with a cached path, in tokens
    miss_reason: str | None  # why no deeper point was usable
    snapshots_taken: int  # snapshots the request added
    output_tokens: int  # tokens generated
    ttft_s: float  # wall time from submitting the request to its first token
    restarted_before: bool = False  # the server restarted just before this request


@dataclass
class SnapshotPoint:
    """One snapshot the cache held when a workload ended."""

    position: int  # its token position
    source: str  # placement rule that made it
    tier: str  # the fastest tier holding a copy
    tiers: list[str] = field(default_factory=list)  # every tier holding a copy, fastest first


@dataclass
class WorkloadResult:
    workload: str  # workload name
    policy: str  # cache policy name (or the label of a server run over HTTP)
    requests: list[RequestRecord] = field(default_factory=list)
    snapshots: list[SnapshotPoint] = field(default_factory=list)  # engine runs: the cache at the end
    skipped: str | None = None  # why the workload did not run, if it did not

    def totals(self) -> dict:
        """Sums over the requests; reuse_of_oracle = cached / oracle (None when the oracle is 0)."""
        r = self.requests
        cached, oracle = sum(x.cached_tokens for x in r), sum(x.oracle_tokens for x in r)
        ttft = sum(x.ttft_s for x in r)
        return {"num_requests": len(r), "prompt_tokens": sum(x.prompt_tokens for x in r), "cached_tokens": cached,
                "computed_tokens": sum(x.computed_tokens for x in r), "oracle_tokens": oracle,
                "reuse_of_oracle": cached / oracle if oracle else None, "ttft_total_s": ttft,
                "ttft_mean_s": ttft / len(r) if r else None}

    def ttft_of(self, label: str) -> float | None:
        return next((x.ttft_s for x in self.requests if x.label == label), None)


@dataclass(frozen=True)
class Target:
    name: str  # what the issue asks for
    workload: str  # the workload it is measured on
    metric: str  # "reuse_of_oracle" or "replay_warm_over_cold"
    threshold: float
    at_most: bool  # met when value <= threshold; else when value >= threshold


TARGETS = (
    Target("compaction replay: warm / cold time to first token", "compaction", "replay_warm_over_cold", 0.02, True),
    Target("agentic session: reused / oracle (default budget)", "agentic", "reuse_of_oracle", 0.95, False),
    Target("interleave: reused / oracle", "interleave", "reuse_of_oracle", 0.97, False),
    Target("restart: reused / oracle", "restart", "reuse_of_oracle", 0.97, False),
)


@dataclass
class TargetResult:
    name: str
    workload: str
    policy: str  # the policy the target is judged on (cairn, or the server run)
    metric: str
    threshold: float
    comparison: str  # "<=" or ">="
    value: float | None  # None when it could not be measured (see note)
    met: bool | None
    note: str = ""


def replay_warm_over_cold(results: list[WorkloadResult], policy: str) -> float | None:
    """The compaction replay's time to first token under `policy` over the same replay with no cache."""
    by_policy = {r.policy: r for r in results if r.workload == "compaction" and not r.skipped}
    warm = by_policy[policy].ttft_of(REPLAY_LABEL) if policy in by_policy else None
    cold = by_policy["none"].ttft_of(REPLAY_LABEL) if "none" in by_policy else None
    return warm / cold if warm is not None and cold else None


def why_missed(results: list[WorkloadResult], result: WorkloadResult, metric: str, policy: str) -> str:
    """One line on where a missed target's shortfall comes from, in the run's own figures."""
    if metric == "replay_warm_over_cold":
        warm = next(x for x in result.requests if x.label == REPLAY_LABEL)
        cold = next(x for r in results if r.workload == "compaction" and r.policy == "none"
                    for x in r.requests if x.label == REPLAY_LABEL)
        return (f"the warm replay computed {warm.computed_tokens} of {warm.prompt_tokens} tokens in "
                f"{warm.ttft_s:.3f} s, the cold one all {cold.prompt_tokens} in {cold.ttft_s:.3f} s: what is left is "
                "the new tokens' prefill and a model step's fixed cost, which a longer replay amortises "
                "(--preset published)")
    worst = max(result.requests, key=lambda x: x.oracle_tokens - x.cached_tokens)
    return (f"the largest shortfall is {worst.label!r}: {worst.cached_tokens} of {worst.oracle_tokens} reusable "
            f"tokens resumed (at {worst.resume_position}, miss reason {worst.miss_reason or 'none'})")


def evaluate_targets(results: list[WorkloadResult], policy: str) -> list[TargetResult]:
    out = []
    for t in TARGETS:
        result = next((r for r in results if r.workload == t.workload and r.policy == policy), None)
        value, note = None, ""
        if result is None:
            note = f"{t.workload} with policy {policy} was not run"
        elif result.skipped:
            note = f"skipped: {result.skipped}"
        elif t.metric == "reuse_of_oracle":
            value = result.totals()["reuse_of_oracle"]
        else:
            value = replay_warm_over_cold(results, policy)
            note = "" if value is not None else "needs the 'none' policy in the same run for the cold time"
        met = None if value is None else (value <= t.threshold if t.at_most else value >= t.threshold)
        if met is False:
            note = why_missed(results, result, t.metric, policy)
        out.append(TargetResult(t.name, t.workload, policy, t.metric, t.threshold, "<=" if t.at_most else ">=",
                                value, met, note))
    return out


@dataclass
class BenchRecord:
    schema: str  # SCHEMA
    created_utc: str  # ISO 8601
    command: str  # the command line that produced it
    target: str  # "engine" (in-process) or the server's URL
    model: str  # checkpoint directory, or a demo model's name
    size: str  # "demo", "tiny", "0.8b" (random weights) or "checkpoint"
    preset: str  # workload sizes preset
    seed: int  # workload seed
    min_gap_tokens: int  # the user_messages (llama.cpp-style) policy's spacing
    engine_config: dict  # EngineConfig shared by every policy (the policy fields aside); {} over HTTP
    sizes: dict  # WorkloadSizes
    policies: list[str]
    workloads: list[str]
    environment: dict  # python, torch, threads, platform, git commit
    results: list[WorkloadResult] = field(default_factory=list)
    targets: list[TargetResult] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # PNG paths

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        for result, obj in zip(data["results"], self.results, strict=True):
            result["totals"] = obj.totals()
        return data

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
