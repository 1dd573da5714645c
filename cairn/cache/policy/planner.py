"""The resume planner (DESIGN §4.3): which cached point a request resumes from, chosen by estimated time
to first token across tiers. A pure function with no tree, tensors or I/O: the cache describes each
usable resume point as a `Candidate` and measured speeds as `Speeds`.

For a candidate at position p:

    estimated_s = sum over tiers t of bytes_to_load[t] / bandwidth[t]     (KV of [0, p) and the snapshot)
                + (prompt_len - p) / prefill_tokens_per_s                  (the suffix still to compute)

The fastest estimate wins; an equal estimate prefers the faster tier (device, then host, then disk),
then the deeper point. Position 0 (a cold prefill) is always a candidate. The plan records, for
every deeper point that was not chosen, why.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """One usable resume point: a snapshot at `position` with KV for [0, position) somewhere."""

    position: int  # tokens resumed
    snapshot_tier: str  # the fastest tier holding the snapshot
    load_bytes: dict[str, int]  # bytes to bring to the device, per tier (device-resident KV counts 0)
    source: str = ""  # placement rule that created the snapshot


@dataclass(frozen=True)
class Speeds:
    """Measured speeds the estimate uses."""

    bandwidth_bytes_per_s: dict[str, float]  # per tier, fastest first: bytes/s of a copy into the slot / pages
    prefill_tokens_per_s: float  # cold prefill speed of this model here


@dataclass
class Plan:
    """The decision for one request."""

    position: int  # resume here (0: cold prefill)
    snapshot_tier: str | None  # the tier the snapshot comes from (None when cold)
    estimated_s: float  # estimated time to first token
    candidate: Candidate | None  # the chosen candidate (None when cold)
    reasons: dict[int, str] = field(default_factory=dict)  # deeper position -> why it was not used


def estimate_s(c: Candidate | None, prompt_len: int, speeds: Speeds) -> float:
    position = 0 if c is None else c.position
    load = 0.0 if c is None else sum(b / speeds.bandwidth_bytes_per_s[t] for t, b in c.load_bytes.items() if b)
    return load + (prompt_len - position) / speeds.prefill_tokens_per_s


def plan(candidates: list[Candidate], prompt_len: int, speeds: Speeds,
         unusable: dict[int, str] | None = None) -> Plan:
    """Choose the fastest resume point. `unusable`: deeper positions the cache could not offer, with why
    (no snapshot, evicted, corrupt, ...); they are copied into the plan's reasons."""
    best = Plan(0, None, estimate_s(None, prompt_len, speeds), None)
    for c in candidates:
        est = estimate_s(c, prompt_len, speeds)
        order = list(speeds.bandwidth_bytes_per_s)
        if (est, _tier_rank(c, order), -c.position) < (best.estimated_s, _tier_rank(best.candidate, order),
                                                       -best.position):
            best = Plan(c.position, c.snapshot_tier, est, c)
    for c in candidates:
        if c.position > best.position:
            best.reasons[c.position] = f"slower ({c.snapshot_tier}: est {estimate_s(c, prompt_len, speeds):.3f}s)"
    for position, why in (unusable or {}).items():
        if position > best.position:
            best.reasons.setdefault(position, why)
    return best


def _tier_rank(c: Candidate | None, order: list[str]) -> int:
    """Rank of the slowest tier a candidate loads from (-1 for a cold prefill, which loads nothing); `order`:
    the tier names fastest first (the order of Speeds.bandwidth_bytes_per_s)."""
    if c is None:
        return -1
    used = [t for t, b in c.load_bytes.items() if b] + [c.snapshot_tier]
    return max(order.index(t) for t in used)
