"""Tier: what every storage tier of the prefix cache implements, so that TierSet can treat them as one list.

A tier holds copies of snapshots (a recurrent-state slot plus, optionally, the logits at its position)
and copies of nodes' KV. TierSet orders its tiers fastest first; demoting is storing into the next
one and freeing here. Two kinds exist: page tiers (device, host: preallocated slots and KV pages,
`pages` is the allocator the radix tree counts references on, `PageTier`) and segment tiers (disk, and
any store of segments: a node's KV and its snapshot written together as one segment, `pages` is None).
Across that, the first tier (the device: requests write it) is never stored into; every tier below it
is (`LowerTier`). Which methods each tier serves:

                    Tier (read, free)   LowerTier (stored into)   PageTier (budget)   the first tier only
    device          yes                 -                         yes                 store, reserve
    host            yes                 yes                       yes                 -
    disk, remote    yes                 yes                       -                   -

`Source` is what a tier reads from when it stores: the node's KV and snapshot from their fastest copy.
Copies are synchronous (a store has finished when it returns). What this is not: the victim choice
(tree/tiered.py) or the demotion order (tier_set.py).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

from cairn.cache.tree.nodes import Node
from cairn.memory.pages import PageAllocator
from cairn.memory.state_pool import StatePool

State = tuple[dict[str, torch.Tensor], torch.Tensor | None]  # (named state tensors as read_slot names them, logits)
KV = tuple[torch.Tensor, torch.Tensor]  # (k, v) of pages: [layers, pages, page_size, kv_heads, head_dim] each
# why a stored copy could not be read (a segment tier's; a page tier's copies are always readable): "corrupt" (it
# failed verification, or could not be read), "evicted" (its store no longer had the value: evicted, expired, its
# file deleted) or "unavailable" (its store did not answer: Redis down). The cache's miss_reason.
Unreadable = Literal["corrupt", "evicted", "unavailable"]


class Source(Protocol):
    def node_kv(self, node: Node) -> KV | None: ...  # None: unreadable (a bad segment)

    def node_snapshot(self, node: Node) -> State | None: ...  # None: no readable copy


class Tier(Protocol):
    """What TierSet asks of every tier, the first (the device) included: reading and freeing its copies."""

    name: str  # the key of this tier's copies in Node.kv and TieredSnapshot.copies
    bandwidth: float  # bytes/s of bringing its bytes to the device (start-up value; the planner prices by it)
    pages: PageAllocator | None  # a page tier's KV page allocator; None for a segment tier
    write_through: bool  # a finished request's path is written here at once (segment tiers may)

    def fits(self, with_logits: bool) -> bool: ...  # one more snapshot fits without evicting here

    def load_snapshot(self, copy: Any, dst: StatePool, slot: int) -> torch.Tensor | None | Unreadable: ...
    # copies the state into dst[slot]; returns its logits (or None), or why the copy is unreadable (then dst[slot]
    # is unspecified)

    def read_snapshot(self, copy: Any) -> State | None: ...

    def free_snapshot(self, copy: Any) -> None: ...

    def read_kv(self, node: Node) -> KV | None: ...  # node's pages from this tier's copy


class LowerTier(Tier, Protocol):
    """A tier below the first (host, disk, remote): demotion and write-through store into it, and a resume
    reads its pages one by one. The first tier (the device) is never stored into from a `Source`: nothing
    is above it; requests write it (tiers/pools.py's DeviceTier)."""

    def store_snapshot(self, node: Node, source: Source) -> Any | None: ...  # a copy of node's snapshot

    def kv_fits(self, num_pages: int) -> bool: ...

    def store_kv(self, node: Node, source: Source) -> Any | None: ...  # a copy of node's KV (None: failed)

    def read_page(self, node: Node, i: int, cache: dict) -> KV | Unreadable: ...
    # node's i-th page, or why its copy is unreadable; cache: kept by the caller for one load (a tier's own use)


class PageTier(Tier, Protocol):
    """A tier of preallocated pools (device, host): a snapshot byte budget it never exceeds, and KV pages
    the radix tree counts references on. A segment tier has neither: its store keeps its own budget, and the
    cache's stats read the store."""

    pages: PageAllocator
    used_bytes: int  # snapshot bytes held
    budget_bytes: int  # the most it holds (TierSet.check_integrity, the stats' gauges)
