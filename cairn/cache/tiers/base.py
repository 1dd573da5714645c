"""Tier: what every storage tier of the prefix cache implements, so that TierSet can treat them as one list.

A tier holds copies of snapshots (a recurrent-state slot plus, optionally, the logits at its position)
and copies of nodes' KV. TierSet orders its tiers fastest first; demoting is storing into the next
one and freeing here. Two kinds exist: page tiers (device, host: preallocated slots and KV pages,
`pages` is the allocator the radix tree counts references on) and segment tiers (disk, and any store
of segments: a node's KV and its snapshot written together as one segment, `pages` is None).

`Source` is what a tier reads from when it stores: the node's KV and snapshot from their fastest copy.
Copies are synchronous (a store has finished when it returns). What this is not: the victim choice
(tree/tiered.py) or the demotion order (tier_set.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from cairn.cache.tree.nodes import Node
from cairn.memory.pages import PageAllocator
from cairn.memory.state_pool import StatePool

State = tuple[dict[str, torch.Tensor], torch.Tensor | None]  # (named state tensors as read_slot names them, logits)
KV = tuple[torch.Tensor, torch.Tensor]  # (k, v) of pages: [layers, pages, page_size, kv_heads, head_dim] each


class Source(Protocol):
    def node_kv(self, node: Node) -> KV | None: ...  # None: unreadable (a bad segment)

    def node_snapshot(self, node: Node) -> State | None: ...  # None: no readable copy


class Tier(Protocol):
    name: str  # the key of this tier's copies in Node.kv and TieredSnapshot.copies
    bandwidth: float  # bytes/s of bringing its bytes to the device (start-up value; the planner prices by it)
    pages: PageAllocator | None  # a page tier's KV page allocator; None for a segment tier
    used_bytes: int  # snapshot bytes held (a segment tier: its store's bytes)
    budget_bytes: int
    write_through: bool  # a finished request's path is written here at once (segment tiers may)

    # ---- snapshots ----
    def fits(self, with_logits: bool) -> bool: ...  # one more snapshot fits without evicting here

    def reserve(self, with_logits: bool = False) -> Any | None: ...  # a slot a model step writes (page tiers)

    def store_snapshot(self, node: Node, source: Source) -> Any | None: ...  # a copy of node's snapshot

    def load_snapshot(self, copy: Any, dst: StatePool, slot: int) -> torch.Tensor | None | bool: ...
    # copies the state into dst[slot]; returns its logits (or None), False when the copy is unreadable

    def read_snapshot(self, copy: Any) -> State | None: ...

    def free_snapshot(self, copy: Any) -> None: ...

    # ---- KV ----
    def kv_fits(self, num_pages: int) -> bool: ...

    def store_kv(self, node: Node, source: Source) -> Any | None: ...  # a copy of node's KV (None: failed)

    def read_kv(self, node: Node) -> KV | None: ...  # node's pages from this tier's copy

    def read_page(self, node: Node, i: int, cache: dict) -> KV | None: ...  # node's i-th page; cache: per load
