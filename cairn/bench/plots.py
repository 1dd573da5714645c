"""The benchmark's PNG plots (matplotlib, Agg backend: no display needed).

    ttft_<workload>.png       time to first token per request, one line per policy, log scale
    snapshots_<workload>.png  the snapshots one policy's cache held when the workload ended: position
                              along the conversation, one row per placement source, coloured by tier;
                              below, where each request resumed and how long its prompt was
    reuse.png                 reused / oracle per workload and policy

Legends sit outside the axes, so they never cover data. `python -m cairn.bench.plots DIR` draws the
plots again from DIR/record.json (after a change here, without rerunning the benchmark).

What it is not: the numbers (record.py) or the tables (report.py).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cairn.bench.policies import LABELS  # noqa: E402
from cairn.bench.record import RequestRecord, SnapshotPoint, WorkloadResult  # noqa: E402

TIER_COLOURS = {"device": "tab:blue", "host": "tab:orange", "disk": "tab:green"}
SOURCES = ("grid", "message", "breakpoint", "prompt_end", "request_end", "branch", "disk", "remote")


def _label(policy: str) -> str:
    return LABELS.get(policy, policy)


def plot_ttft(results: list[WorkloadResult], workload: str, path: Path) -> Path | None:
    """Time to first token per request of `workload`, one line per policy (log scale)."""
    runs = [r for r in results if r.workload == workload and r.requests]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for r in runs:
        ax.plot([x.index for x in r.requests], [x.ttft_s for x in r.requests], marker="o", markersize=3,
                label=_label(r.policy))
    for x in runs[0].requests:
        if "compaction" in x.label or x.restarted_before:
            ax.axvline(x.index, color="grey", linestyle="--", linewidth=0.8)
            ax.annotate("compaction" if "compaction" in x.label else "restart", (x.index, 1), xycoords=("data",
                        "axes fraction"), xytext=(2, -12), textcoords="offset points", fontsize=8, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel(f"request ({workload})")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{workload}: time to first token per request and cache policy")
    ax.grid(True, which="both", alpha=0.3)
    _legend_right(ax)
    return _save(fig, path)


def plot_snapshots(result: WorkloadResult, path: Path) -> Path:
    """The snapshot map of one run (one that took snapshots): positions by source, coloured by tier; resume
    points underneath."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, height_ratios=(3, 2))
    rows = {s: i for i, s in enumerate(SOURCES)}
    for tier in sorted({p.tier for p in result.snapshots}):
        pts = [p for p in result.snapshots if p.tier == tier]
        top.scatter([p.position for p in pts], [rows.get(p.source, len(rows)) for p in pts], marker="|", s=200,
                    color=TIER_COLOURS.get(tier, "tab:grey"), label=f"{tier} ({len(pts)})")
    top.set_yticks(range(len(SOURCES)), SOURCES)
    top.set_ylim(-0.7, len(SOURCES) - 0.3)
    top.set_title(f"{result.workload}, policy {_label(result.policy)}: {len(result.snapshots)} snapshots held at "
                  f"the end, by placement source and tier")
    if result.snapshots:
        _legend_right(top, title="tier")
    reqs = result.requests
    bottom.barh([x.index for x in reqs], [x.prompt_tokens for x in reqs], color="lightgrey", label="prompt")
    bottom.scatter([x.resume_position for x in reqs], [x.index for x in reqs], color="tab:red", s=12, zorder=3,
                   label="resumed at")
    bottom.scatter([x.oracle_tokens for x in reqs], [x.index for x in reqs], color="black", marker="x", s=12,
                   zorder=3, label="oracle")
    bottom.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    bottom.invert_yaxis()
    bottom.set_ylabel("request")
    bottom.set_xlabel("token position")
    _legend_right(bottom)
    return _save(fig, path)


def plot_reuse(results: list[WorkloadResult], path: Path) -> Path | None:
    """Reused / oracle per workload (groups) and policy (bars)."""
    ran = [r for r in results if r.requests and r.totals()["reuse_of_oracle"] is not None]
    if not ran:
        return None
    workloads = list(dict.fromkeys(r.workload for r in ran))
    policies = list(dict.fromkeys(r.policy for r in ran))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(10, 4))
    for j, policy in enumerate(policies):
        values = [next((r.totals()["reuse_of_oracle"] for r in ran if r.workload == w and r.policy == policy), 0.0)
                  for w in workloads]
        ax.bar([i + j * width for i in range(len(workloads))], values, width, label=_label(policy))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("reused / oracle")
    ax.set_title("prompt tokens reused, as a fraction of what an unlimited cache could reuse")
    ax.legend(fontsize=8, ncols=len(policies), loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    return _save(fig, path)


def _legend_right(ax, **kw) -> None:
    """The legend outside the axes, on their right, so that it never covers data."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kw)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # keeps the legends placed outside the axes
    plt.close(fig)
    return path


def plot_all(results: list[WorkloadResult], out_dir: Path, snapshot_policy: str) -> list[Path]:
    """Every plot the results allow: TTFT of the agentic session, its snapshot map under
    `snapshot_policy`, and the reuse bars."""
    made = [plot_ttft(results, "agentic", out_dir / "ttft_agentic.png")]
    mapped = next((r for r in results if r.workload == "agentic" and r.policy == snapshot_policy), None)
    if mapped is not None and mapped.snapshots:  # over HTTP the cache's snapshots are not visible
        made.append(plot_snapshots(mapped, out_dir / "snapshots_agentic.png"))
    made.append(plot_reuse(results, out_dir / "reuse.png"))
    return [p for p in made if p is not None]


def results_from_record(record: dict) -> list[WorkloadResult]:
    """The WorkloadResults of a record.json (as BenchRecord.to_json wrote it)."""
    return [WorkloadResult(r["workload"], r["policy"], [RequestRecord(**x) for x in r["requests"]],
                           [SnapshotPoint(**p) for p in r["snapshots"]], r.get("skipped"))
            for r in record["results"]]


if __name__ == "__main__":
    import json
    import sys

    out = Path(sys.argv[1])
    record = json.loads((out / "record.json").read_text())
    policy = "server" if record["target"] != "engine" else "cairn"
    print("\n".join(str(p) for p in plot_all(results_from_record(record), out, policy)))
