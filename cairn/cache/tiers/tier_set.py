"""TierSet: moving snapshots and KV between the device, host and disk tiers (DESIGN invariant 3).

Eviction demotes before it drops: a device snapshot or KV page that must leave the device is copied
to the host unless a slower tier already holds it; a host item that must leave goes to disk the same
way; only the last tier drops, and every drop is counted with its reason. Restoring copies into the
request's working slot and fresh device pages; the stored copies stay where they are.

What this is not: it does not choose resume points (policy/planner.py) or placement (policy/placement.py); it
keeps the radix tree's location records in step with the bytes it moves.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from cairn.cache.disk.tier import DiskTier
from cairn.cache.tiers.pools import HostKVBank, PoolSnapshotTier, StoredSnapshot
from cairn.cache.tree.nodes import RELEASE_EVICTED, Node
from cairn.cache.tree.tiered import KVVictims, SnapshotVictims, TieredRadixTree
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TieredSnapshot:
    """Where the copies of one snapshot live (the radix tree's opaque snapshot handle)."""

    has_logits: bool
    device: StoredSnapshot | None = None
    host: StoredSnapshot | None = None
    disk: bytes | None = None  # key of the disk segment holding it

    def tiers(self) -> tuple[str, ...]:
        """Tiers holding a copy, fastest first."""
        return tuple(t for t, v in (("device", self.device), ("host", self.host), ("disk", self.disk))
                     if v is not None)


class TierSet:
    def __init__(self, kv: KVPool, device: PoolSnapshotTier, host: PoolSnapshotTier | None = None,
                 host_kv: HostKVBank | None = None, disk: DiskTier | None = None):
        self.kv, self.device, self.host, self.host_kv, self.disk = kv, device, host, host_kv, disk
        self.tree: TieredRadixTree | None = None  # bound by the cache
        self.moved: Counter[str] = Counter()  # "snapshot device->host", "kv host->disk", ...
        self.dropped: Counter[str] = Counter()  # snapshots / KV dropped by the last tier, by reason

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t for t, v in (("device", self.device), ("host", self.host), ("disk", self.disk)) if v)

    # ---- snapshots --------------------------------------------------------------------------------

    def store_snapshot(self, states: StatePool, slot: int, logits: torch.Tensor | None) -> TieredSnapshot | None:
        """A device copy of states[slot], demoting device snapshots to make room; None if none can move."""
        if not self._make_snapshot_room("device", logits is not None):
            return None
        stored = self.device.store(states, slot, logits)
        return TieredSnapshot(logits is not None, device=stored)

    def reserve_snapshot(self) -> TieredSnapshot | None:
        """A device slot for a state a model step will capture, demoting to make room; None if none can move."""
        if not self._make_snapshot_room("device", False):
            return None
        return TieredSnapshot(False, device=self.device.reserve())

    def _make_snapshot_room(self, tier: str, with_logits: bool) -> bool:
        """Demote `tier`'s snapshots in retention order until one more fits; False when none can move."""
        pool: PoolSnapshotTier = getattr(self, tier)
        victims = None
        while not pool.fits(with_logits):
            victims = victims or SnapshotVictims(self.tree, lambda e: getattr(e.handle, tier) is not None)
            node = victims.pop()
            if node is None:
                return False
            self.demote_snapshot(node, tier)
        return True

    def demote_snapshot(self, node: Node, tier: str) -> None:
        """Move node's snapshot copy off `tier` (to the next tier down unless a slower one holds it)."""
        handle: TieredSnapshot = node.snapshot.handle
        copy: StoredSnapshot = getattr(handle, tier)
        below = self.names[self.names.index(tier) + 1:]
        if not any(getattr(handle, t) is not None for t in below):
            if tier == "device" and self.host is not None:
                self._snapshot_to_host(handle, copy)
            if (tier == "host" or handle.host is None) and self.disk is not None:
                self._persist(node)
        getattr(self, tier).free(copy)
        setattr(handle, tier, None)
        if not handle.tiers():
            self.dropped[f"snapshot_{tier}_full"] += 1
            self.tree.remove_snapshot(node, RELEASE_EVICTED)

    def _snapshot_to_host(self, handle: TieredSnapshot, copy: StoredSnapshot) -> None:
        if not self._make_snapshot_room("host", handle.has_logits):
            return
        handle.host = self.host.store(self.device.pool, copy.slot, copy.logits)
        self.moved["snapshot device->host"] += 1

    def release(self, handle: TieredSnapshot) -> None:
        """Free a snapshot's device and host copies (disk files stay, LRU there)."""
        for tier in ("device", "host"):
            copy = getattr(handle, tier)
            if copy is not None:
                getattr(self, tier).free(copy)
                setattr(handle, tier, None)

    def restore_snapshot(self, handle: TieredSnapshot, tier: str, states: StatePool, slot: int):
        """Copy the snapshot's `tier` copy into states[slot]; returns its logits (or None), or False when
        the disk copy turned out unreadable (the caller marks the segment bad)."""
        if tier in ("device", "host"):
            return getattr(self, tier).restore(getattr(handle, tier), states, slot)
        segment = self.disk.read(handle.disk)
        snap = None if segment is None else self.disk.snapshot_of(segment)
        if snap is None:
            return False
        states.write_slot(slot, snap.tensors)
        return None if snap.logits is None else snap.logits.to(states.device)

    # ---- KV ---------------------------------------------------------------------------------------

    def free_device_pages(self, num_pages: int) -> int:
        """Demote (or drop) least-recently-used device KV until num_pages pages are free; returns freed."""
        freed = 0
        victims = {"device": KVVictims(self.tree, "device")}  # "host" joins when a device victim needs room there
        while freed < num_pages:
            node = victims["device"].pop()
            if node is None:
                break
            if node.host_pages is None and node.disk is None:
                self._kv_to_host(node, victims)
                if node.host_pages is None and self.disk is not None:
                    self._persist(node)
            if not node.host_pages and node.disk is None:
                self.dropped["kv_device_full"] += 1
            freed += self._drop_kv(node, "device", victims)
        return freed

    def _drop_kv(self, node: Node, tier: str, victims: dict[str, KVVictims]) -> int:
        """tree.drop_kv, then offer the parent to this call's victim queues (it may have become a candidate)."""
        parent = node.parent
        freed = self.tree.drop_kv(node, tier)
        for queue in victims.values():
            queue.push(parent)
        return freed

    def _kv_to_host(self, node: Node, victims: dict[str, KVVictims]) -> None:
        if self.host_kv is None:
            return
        while self.host_kv.allocator.num_free < len(node.pages):
            if "host" not in victims:
                victims["host"] = KVVictims(self.tree, "host")
            victim = victims["host"].pop()
            if victim is None:
                return
            if victim.disk is None and self.disk is not None:
                self._persist(victim)
            if victim.disk is None:
                self.dropped["kv_host_full"] += 1
            self._drop_kv(victim, "host", victims)
        self.tree.adopt_host_pages(node, self.host_kv.copy_in(self.kv, node.pages))
        if "host" in victims:
            victims["host"].push(node)
        self.moved["kv device->host"] += 1

    def page_copy(self, node: Node, i: int, segments: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) of node's i-th page from its fastest non-device copy, or None when unreadable."""
        if node.host_pages is not None:
            p = node.host_pages[i]
            return self.host_kv.k[:, p], self.host_kv.v[:, p]
        key = node.disk.key
        if key not in segments:
            segment = self.disk.read(key)
            segments[key] = None if segment is None else self.disk.kv_of(segment)
        if segments[key] is None:
            return None
        k, v = segments[key]
        j = node.start // self.kv.page_size + i - node.disk.segment_start // self.kv.page_size
        return k[:, j], v[:, j]

    # ---- disk -------------------------------------------------------------------------------------

    def _persist(self, node: Node) -> None:
        path = list(reversed(list(self.tree._ancestors(node))))
        self.disk.persist(path, self._node_kv, self._node_snapshot)
        self.moved["persisted"] += 1

    def persist_path(self, node: Node) -> None:
        """Write node and its ancestors to disk where they are not yet (write-through at request end)."""
        if self.disk is not None and node is not self.tree.root:
            self._persist(node)

    def _node_kv(self, node: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) of node's pages from its fastest copy; None when that is a disk segment found unreadable."""
        if node.pages is not None:
            index = torch.tensor(node.pages, device=self.kv.k.device)
            return self.kv.k[:, index], self.kv.v[:, index]
        if node.host_pages is not None:
            index = torch.tensor(node.host_pages)
            return self.host_kv.k[:, index], self.host_kv.v[:, index]
        segment = self.disk.read(node.disk.key)  # rewriting a segment to add the snapshot it lacks
        return None if segment is None else self.disk.kv_of(segment)

    def _node_snapshot(self, node: Node):
        if node.snapshot is None:
            return None
        handle: TieredSnapshot = node.snapshot.handle
        copy = handle.device or handle.host
        if copy is None:
            return None
        pool = (self.device if copy is handle.device else self.host).pool
        return pool.read_slot(copy.slot), copy.logits
