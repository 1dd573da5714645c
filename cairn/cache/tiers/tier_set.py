"""TierSet: moving snapshots and KV down an ordered list of tiers, fastest first (DESIGN invariant 3).

Eviction demotes before it drops: a snapshot or KV copy that must leave a tier is stored into the
next tier down that takes it (making room there the same way) unless a slower tier already holds
it; only when no slower tier takes it is it dropped, and every drop is counted with its reason.
A page tier's snapshots leave in retention order, the pins of clients' cache breakpoints it holds
last (policy/pins.py).
Restoring copies into the request's working slot and fresh device pages; the stored copies stay, and
what a resume read from a slower tier is put back on the device (`promote`).
The tiers are `Tier` objects (tiers/base.py): the device (a `DeviceTier`) first, then the `LowerTier`s,
e.g. host and disk; adding one is a class and a line in the factory, nothing here.

What this is not: it does not choose resume points (policy/planner.py), placement (policy/placement.py)
or victims (tree/tiered.py); it keeps the radix tree's location records in step with the bytes it moves.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cairn.cache.policy.pins import held_pins
from cairn.cache.tiers.base import KV, LowerTier, PageTier, Source, State, Tier, Unreadable
from cairn.cache.tiers.pools import DeviceTier
from cairn.cache.tree.nodes import DEVICE, RELEASE_EVICTED, Node, SnapshotEntry, page_indices
from cairn.cache.tree.tiered import KVVictims, SnapshotVictims, TieredRadixTree
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TieredSnapshot:
    """Where the copies of one snapshot live (the radix tree's opaque snapshot handle)."""

    has_logits: bool
    copies: dict[str, Any] = field(default_factory=dict)  # tier name -> that tier's copy (slot, segment key)


class TierSet:
    def __init__(self, device: DeviceTier, lower: Sequence[LowerTier] = (), pin_share: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        """`pin_share`: the share of each page tier's snapshot budget that the pins of clients' cache breakpoints
        hold ahead of other snapshots (0: none is held); `clock`: the pins' clock, in seconds."""
        self.device = device  # the first tier: requests write it, nothing is stored into it
        self.tiers: list[Tier] = [device, *lower]  # fastest first
        self.by_name = {tier.name: tier for tier in self.tiers}
        self.tree: TieredRadixTree | None = None  # bound by the cache
        self.moved: Counter[str] = Counter()  # "snapshot device->host", "kv host->disk", ...
        self.dropped: Counter[str] = Counter()  # snapshots / KV dropped by the last tier, by reason
        self.pin_share, self.clock = pin_share, clock
        self.pins: Counter[str] = Counter()  # "pinned", "refreshed" (the cache's), "expired", "demoted" (a held
        #   pin moved off a tier because nothing unpinned was left there)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    @property
    def page_tiers(self) -> list[PageTier]:
        """The tiers holding KV in pages (device, host), fastest first."""
        return [tier for tier in self.tiers if tier.pages is not None]

    def page_allocators(self) -> dict:
        """Tier name -> KV page allocator, for every page tier (the tree counts references on them)."""
        return {tier.name: tier.pages for tier in self.page_tiers}

    def holding(self, copies: dict[str, Any]) -> list[Tier]:
        """The tiers among `copies`' keys, fastest first (copies: a node's kv or a snapshot handle's copies)."""
        return [tier for tier in self.tiers if tier.name in copies]

    def _below(self, tier: Tier) -> list[LowerTier]:
        return self.tiers[self.tiers.index(tier) + 1:]

    # ---- reading a node's fastest copy (the `Source` a tier stores from) ---------------------------

    def node_kv(self, node: Node) -> KV | None:
        tier = self.holding(node.kv)[0]
        return tier.read_kv(node)

    def node_snapshot(self, node: Node) -> State | None:
        if node.snapshot is None:
            return None
        handle: TieredSnapshot = node.snapshot.handle
        for tier in self.holding(handle.copies):
            state = tier.read_snapshot(handle.copies[tier.name])
            if state is not None:
                return state
        return None

    def request_source(self, kv: KVPool, page_table: list[int]) -> Source:
        """The `Source` a finished request's path is written from: these tiers, except for a node no page tier
        holds (see _RequestSource)."""
        return _RequestSource(self, kv, page_table)

    # ---- snapshots --------------------------------------------------------------------------------

    def store_snapshot(self, states: StatePool, slot: int, logits: torch.Tensor | None) -> TieredSnapshot | None:
        """A device copy of states[slot], demoting device snapshots to make room; None if none can move."""
        if not self._make_snapshot_room(self.device, logits is not None):
            return None
        return TieredSnapshot(logits is not None, {DEVICE: self.device.store(states, slot, logits)})

    def reserve_snapshot(self) -> TieredSnapshot | None:
        """A device slot for a state a model step will capture, demoting to make room; None if none can move."""
        if not self._make_snapshot_room(self.device, False):
            return None
        return TieredSnapshot(False, {DEVICE: self.device.reserve()})

    def _make_snapshot_room(self, tier: Tier, with_logits: bool) -> bool:
        """Demote `tier`'s snapshots until one more fits, the pins it holds last; False when none can move."""
        victims = None
        while not tier.fits(with_logits):
            victims = victims or _PinnedLast(self, tier)
            node = victims.pop()
            if node is None:
                return False
            self.demote_snapshot(node, tier)
        return True

    def demote_snapshot(self, node: Node, tier: Tier) -> None:
        """Move node's snapshot copy off `tier`: into the first slower tier that takes it, unless one holds it."""
        handle: TieredSnapshot = node.snapshot.handle
        below = self._below(tier)
        if not any(t.name in handle.copies for t in below):
            for slower in below:
                if self._make_snapshot_room(slower, handle.has_logits):
                    copy = slower.store_snapshot(node, self)
                    if copy is not None:
                        handle.copies[slower.name] = copy
                        self.moved[f"snapshot {tier.name}->{slower.name}"] += 1
                        break
        tier.free_snapshot(handle.copies.pop(tier.name))
        if not handle.copies:
            self.dropped[f"snapshot_{tier.name}_full"] += 1
            self.tree.remove_snapshot(node, RELEASE_EVICTED)

    # ---- pins -------------------------------------------------------------------------------------

    def expire_pins(self) -> float:
        """Clear the pins whose time is up (their snapshots fall back to ordinary retention); returns now."""
        now = self.clock()
        if not self.pin_share:  # the cache pins nothing then: no walk of the snapshots on every eviction call
            return now
        for _, entry, _ in self.tree.iter_snapshots():
            if 0 < entry.pinned_until <= now:
                entry.pinned_until = 0.0
                self.pins["expired"] += 1
        return now

    def held_pins(self, tier: Tier, now: float) -> list[tuple[SnapshotEntry, Node]]:
        """The pinned snapshots `tier` (a page tier) holds ahead of the others, soonest-expiring first."""
        if not self.pin_share or tier.pages is None:
            return []
        on_tier = {id(entry): node for _, entry, node in self.tree.iter_snapshots() if tier.name in entry.handle.copies}
        held = held_pins((n.snapshot for n in on_tier.values()), int(self.pin_share * tier.budget_bytes), now)
        return [(entry, on_tier[id(entry)]) for entry in held]

    def pinned_bytes(self) -> dict[str, int]:
        """Page tier name -> bytes of the pinned snapshots it holds ahead of the others."""
        now = self.expire_pins()
        return {tier.name: sum(entry.nbytes for entry, _ in self.held_pins(tier, now)) for tier in self.page_tiers}

    def release(self, handle: TieredSnapshot) -> None:
        """Free every copy of a snapshot the tree let go (a segment tier's file stays, LRU there)."""
        for tier in self.holding(handle.copies):
            tier.free_snapshot(handle.copies.pop(tier.name))

    def promote(self, nodes: Sequence[Node], table: list[int], handle: TieredSnapshot, tier: str, states: StatePool,
                slot: int, logits: torch.Tensor | None) -> None:
        """Put back on the device what a resume just read from slower tiers, so that the next request on the
        prefix (a resend, another conversation sharing it; after a restart, every one) reads device memory:
        each of `nodes` (the path [0, p)) without device KV lists the request's pages `table` it was loaded
        into (the request writes none of its positions; the tree takes a reference of its own), and the
        snapshot restored from `tier` into states[slot] gets a device copy when the device can make room
        for it as for a new one. The slower copies stay, so device eviction later just frees these."""
        for node in nodes:
            if DEVICE not in node.kv:
                source = self.page_source(node).name
                self.tree.share_pages(node, DEVICE, [table[i] for i in page_indices(node.start, node.end,
                                                                                    self.tree.page_size)])
                self.moved[f"kv {source}->{DEVICE}"] += 1
        if DEVICE in handle.copies or not self._make_snapshot_room(self.device, handle.has_logits):
            return
        copy = self.device.store(states, slot, logits if handle.has_logits else None)
        if copy is not None:
            handle.copies[DEVICE] = copy
            self.moved[f"snapshot {tier}->{DEVICE}"] += 1

    def restore_snapshot(self, handle: TieredSnapshot, tier: str, states: StatePool,
                         slot: int) -> torch.Tensor | None | Unreadable:
        """Copy the snapshot's `tier` copy into states[slot]; returns its logits (or None), or why that copy
        turned out unreadable (the caller marks the segment bad, or forgets it)."""
        return self.by_name[tier].load_snapshot(handle.copies[tier], states, slot)

    # ---- KV ---------------------------------------------------------------------------------------

    def free_device_pages(self, num_pages: int) -> int:
        """Demote (or drop) least-recently-used device KV until num_pages pages are free; returns freed."""
        freed = 0
        victims = {DEVICE: KVVictims(self.tree, DEVICE)}  # a slower tier's joins when it must make room
        while freed < num_pages:
            node = victims[DEVICE].pop()
            if node is None:
                break
            self._demote_kv(node, self.device, victims)
            freed += self._drop_kv(node, DEVICE, victims)
        return freed

    def _demote_kv(self, node: Node, tier: Tier, victims: dict[str, KVVictims]) -> None:
        """Store node's KV into the first slower tier that takes it, unless a slower tier holds it already."""
        below = self._below(tier)
        if any(t.name in node.kv for t in below):
            return
        num_pages = len(page_indices(node.start, node.end, self.tree.page_size))
        for slower in below:
            with self.tree.moving(node):  # the room is not made by dropping node's own path from `slower`
                room = self._make_kv_room(slower, num_pages, victims)
            if room:
                copy = slower.store_kv(node, self)
                if copy is not None:
                    if slower.pages is not None:
                        self.tree.adopt_pages(node, slower.name, copy)
                        if slower.name in victims:
                            victims[slower.name].push(node)
                    self.moved[f"kv {tier.name}->{slower.name}"] += 1
                    return
        self.dropped[f"kv_{tier.name}_full"] += 1

    def _make_kv_room(self, tier: LowerTier, num_pages: int, victims: dict[str, KVVictims]) -> bool:
        """Demote (or drop) `tier`'s least-recently-used KV until num_pages pages fit there."""
        while not tier.kv_fits(num_pages):
            if tier.name not in victims:
                victims[tier.name] = KVVictims(self.tree, tier.name)
            victim = victims[tier.name].pop()
            if victim is None:
                return False
            self._demote_kv(victim, tier, victims)
            self._drop_kv(victim, tier.name, victims)
        return True

    def _drop_kv(self, node: Node, tier: str, victims: dict[str, KVVictims]) -> int:
        """tree.drop_kv, then offer the parent to this call's victim queues (it may have become a candidate)."""
        parent = node.parent
        freed = self.tree.drop_kv(node, tier)
        for queue in victims.values():
            queue.push(parent)
        return freed

    def page_source(self, node: Node) -> LowerTier:
        """The tier a resume copies node's pages from: its fastest copy below the device."""
        return next(t for t in self.holding(node.kv) if t.name != DEVICE)

    def page_copy(self, node: Node, i: int, cache: dict) -> tuple[LowerTier, KV | Unreadable]:
        """(the tier, (k, v) of node's i-th page) from page_source(node), or (the tier, why its copy is
        unreadable)."""
        tier = self.page_source(node)
        return tier, tier.read_page(node, i, cache)

    def check_integrity(self) -> None:
        """Raise AssertionError unless each page tier's snapshot bytes are what the tree's snapshots hold there,
        within its budget."""
        for tier in self.page_tiers:
            held = sum(e.handle.copies[tier.name].nbytes for _, e, _ in self.tree.iter_snapshots()
                       if tier.name in e.handle.copies)
            if held != tier.used_bytes or tier.used_bytes > tier.budget_bytes:
                raise AssertionError(f"{tier.name} tier: {tier.used_bytes} bytes used, tree holds {held}, "
                                     f"budget {tier.budget_bytes}")

    def write_through(self, node: Node, source: Source | None = None) -> None:
        """Write node and its ancestors into every write-through segment tier (at a request's end), read from
        `source` (default: the tiers themselves)."""
        for tier in self.tiers:
            if tier.pages is None and tier.write_through and node.end > 0:
                tier.store_kv(node, source or self)


class _PinnedLast:
    """One tier's snapshot victims for one eviction call: the unpinned snapshots (and the pins the tier does not
    hold) in retention order, then the pins it holds, soonest-expiring first (policy/pins.py)."""

    def __init__(self, tiers: TierSet, tier: Tier):
        self.tiers, self.tier = tiers, tier
        held = tiers.held_pins(tier, tiers.expire_pins())
        kept = {id(entry) for entry, _ in held}
        self.unpinned = SnapshotVictims(tiers.tree, lambda e: tier.name in e.handle.copies and id(e) not in kept)
        self.pinned = deque(held)

    def pop(self) -> Node | None:
        node = self.unpinned.pop()
        if node is not None:
            return node
        while self.pinned:
            entry, node = self.pinned.popleft()
            if node.snapshot is entry and not entry.lock_count and self.tier.name in entry.handle.copies:
                self.tiers.pins["demoted"] += 1
                return node
        return None


class _RequestSource:
    """A finished request's `Source`: the tiers, except that a node no page tier holds (its KV only in a
    segment tier: a node split off a segment found in Redis or on disk) is read from the request's own
    pages, which hold what it just computed or loaded for every position of its path."""

    def __init__(self, tiers: TierSet, kv: KVPool, page_table: list[int]):
        self.tiers, self.kv, self.page_table = tiers, kv, page_table

    def node_kv(self, node: Node) -> KV | None:
        if any(tier.pages is not None for tier in self.tiers.holding(node.kv)):
            return self.tiers.node_kv(node)
        return self.kv.read_pages([self.page_table[i] for i in page_indices(node.start, node.end, self.kv.page_size)])

    def node_snapshot(self, node: Node) -> State | None:
        return self.tiers.node_snapshot(node)
