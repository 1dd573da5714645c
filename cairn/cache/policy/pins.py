"""Pins: a client's cache breakpoint keeps its snapshot ahead of unmarked ones for its TTL, within a budget.

A snapshot stored at a client's cache breakpoint (Anthropic's `cache_control`, ttl 5m or 1h) is *pinned*
until now + ttl (`SnapshotEntry.pinned_until`); a later request carrying the same breakpoint over it
extends the pin (Anthropic refreshes a cache entry each time it is read). On a page tier (device, host)
the eviction that makes room for a snapshot takes the unpinned ones first, in retention order
(retention.py), and the pins the tier holds after them, soonest-expiring first: a pinned snapshot moves
down a tier only when nothing else on it can.

The pins a tier holds are bounded by a share of its snapshot budget (`--breakpoint-pin-share`). When
the pinned snapshots on a tier exceed it, the soonest-expiring ones count as unpinned there: they go
first when the budget is full, and hold again if room comes back before they expire. An expired pin is
cleared and its snapshot falls back to ordinary retention; it is not dropped.

This module is the ranking only: which entries hold their pin on one tier. Torch-free; the clock
(time.monotonic seconds) is the caller's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cairn.cache.tree.nodes import SnapshotEntry


def pin(entry: SnapshotEntry, ttl_s: float, now: float) -> None:
    """Pin entry until now + ttl_s, or keep its pin if that runs longer."""
    entry.pinned_until = max(entry.pinned_until, now + ttl_s)


def is_pinned(entry: SnapshotEntry, now: float) -> bool:
    return entry.pinned_until > now


def held_pins(entries: Iterable[SnapshotEntry], budget_bytes: int, now: float) -> list[SnapshotEntry]:
    """The pinned entries among `entries` (those with a copy on one tier) that the tier holds ahead of the
    others: the latest-expiring first, as many as fit in budget_bytes together (the soonest-expiring are left
    out, so every held pin outlives every pin left out). Sorted soonest-expiring first: the order they go
    in when nothing unpinned is left to make room with."""
    pinned = sorted((e for e in entries if is_pinned(e, now)), key=lambda e: e.pinned_until, reverse=True)
    held, used = [], 0
    for entry in pinned:
        if used + entry.nbytes > budget_bytes:
            break
        held.append(entry)
        used += entry.nbytes
    return held[::-1]
