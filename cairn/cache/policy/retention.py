"""Retention order of snapshots: which snapshot the radix tree gives up first (DESIGN §4.2).

This module is the ranking only: it reads a tree's nodes and returns keys. It does not evict, does
not know about tiers and never imports torch; the cache hands `retention_key` to its tree (cache/hybrid.py),
whose `SnapshotVictims` (tree/tiered.py) applies it.

A snapshot's value is the prefill it saves over the nearest snapshot above it on its path (its
*gap*), weighted by how recently its path was used, per byte. The victim is the minimum of

    (entry.last_access, deepest, gap / entry.nbytes, position)

    last_access  older first: the least-recently-used conversation loses first.
    deepest      False before True: a snapshot with another snapshot below it in its subtree goes
                 before the deepest one of its branch (the deepest resumes the longest prompts).
    gap / nbytes prefill tokens saved per byte, smallest first.
    position     shallower first among exact ties.

Worked example: one path with snapshots at 100, 200, 300, 400, equal bytes, all stamped by the same
operation. Gaps are 100, 100, 100, 100 and 400 is deepest, so 100 goes (lowest position). Gaps are now
200 (at 200), 100 (at 300), 100 (at 400, deepest), so 300 goes. Then 200 (gap 200) goes before 400.
Survivors stay spread along the conversation: {200, 300, 400} -> {200, 400} -> {400}.

The key is a total order on one tree: one operation stamps only the snapshots along one root-to-node
chain, so two snapshots with equal `last_access` lie on one chain and differ in position.
Locked snapshots are never ranked, but they still count as the snapshot above (for gaps) and below
(for `deepest`) their neighbours; so do snapshots a tier's eviction does not consider (on a slower
tier, a snapshot still saves prefill for the one below it). Evicting one snapshot changes the gap of
the one below it. Evicting never lowers another snapshot's key (the one below gets a larger gap, the
one above may become deepest) and never changes a recency, which is what lets `SnapshotVictims`
(tree/tiered.py) order candidates once per call and re-check only the key it pops (`retention_key`).
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from cairn.cache.tree.nodes import Node


class RetentionKey(NamedTuple):
    """Sort key of one unlocked snapshot; the smallest is evicted first."""

    last_access: int  # clock tick of the last operation whose path contained the snapshot's position
    deepest: bool  # no other snapshot in the subtree below the snapshot's node
    gap_per_byte: Fraction  # (position - nearest ancestor snapshot's position, or 0) / nbytes
    position: int  # the snapshot's position (its node's end), tokens


def retention_key(node: Node) -> RetentionKey:
    """The current key of node's snapshot, computed from its neighbours alone: O(depth) up to the snapshot
    above, and a walk below that stops at the first snapshot found."""
    above = node.parent
    while above is not None and above.snapshot is None:
        above = above.parent
    entry = node.snapshot
    return RetentionKey(
        last_access=entry.last_access,
        deepest=not _has_snapshot_below(node),
        gap_per_byte=Fraction(node.end - (above.end if above is not None else 0), entry.nbytes),
        position=node.end,
    )


def _has_snapshot_below(node: Node) -> bool:
    stack = list(node.children.values())
    while stack:
        child = stack.pop()
        if child.snapshot is not None:
            return True
        stack.extend(child.children.values())
    return False
