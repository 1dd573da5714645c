"""A real prefix cache in miniature for the radix and eviction tests: CPU pools of a few bytes per slot.

`TinyCache` builds the production objects (KVPool, StatePool, DeviceTier, HostTier, HostKVBank, TierSet,
HybridPrefixCache and its TieredRadixTree) over tiny tensors, so that tests drive the eviction that
runs in the server: `evict_pages` is the scheduler's call, and a snapshot is stored through
`TierSet.store_snapshot`, which demotes (or drops) the retention victims when its tier is full.
Snapshots carry a label (any hashable) so tests can name them; `released` records (label, reason)
for every snapshot the tree let go.
"""

from __future__ import annotations

from collections import Counter

import torch

from cairn.cache.hybrid import HybridPrefixCache
from cairn.cache.policy.placement import PlacementOptions
from cairn.cache.tiers.pools import DeviceTier, HostKVBank, HostTier
from cairn.cache.tiers.tier_set import TierSet
from cairn.cache.tree.nodes import DEVICE, SnapshotEntry
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import LayerState, StateSpec, StateTensor

VOCAB = 6  # logits bytes 4 * VOCAB = 24: a snapshot with logits takes 36 bytes, one without 12


class TinyCache:
    def __init__(self, page_size: int = 4, num_pages: int = 32, device_slots: int = 16, host_slots: int = 0,
                 host_pages: int = 0):
        self.kv = KVPool(1, num_pages, page_size, 1, 1, torch.float32)
        entries = (StateTensor("conv", (2, 1), torch.float32), StateTensor("recurrent", (1, 1, 1), torch.float32))
        self.states = StatePool(StateSpec((LayerState(0, entries),)), 2)
        self.slot_bytes = self.states.bytes_per_slot  # 12
        lower = []
        if host_slots or host_pages:
            host_kv = HostKVBank(self.kv, host_pages * self.kv.bytes_per_page)
            lower.append(HostTier(self.states, host_slots * self.slot_bytes, VOCAB, host_kv, 5e9))
        self.tiers = TierSet(DeviceTier(self.states, device_slots * self.slot_bytes, VOCAB, self.kv, 20e9), lower)
        self.cache = HybridPrefixCache(self.kv, self.states, self.tiers, PlacementOptions(page_size=page_size))
        self.tree, self.alloc = self.cache.tree, self.kv.allocator
        self.labels: dict[int, object] = {}  # id(TieredSnapshot) -> label
        self.released: list[tuple[object, str]] = []
        production = self.tree.on_snapshot_released
        self.tree.on_snapshot_released = lambda entry, reason: (
            self.released.append((self.labels[id(entry.handle)], reason)), production(entry, reason))
        self.slot = self.states.alloc()

    def store(self, label, has_logits: bool = False) -> SnapshotEntry | None:
        """A device copy of the working slot, as a request's snapshot is taken (None: no room could be made)."""
        logits = torch.arange(float(VOCAB)) if has_logits else None
        handle = self.tiers.store_snapshot(self.states, self.slot, logits)
        if handle is None:
            return None
        self.labels[id(handle)] = label
        nbytes = handle.copies[DEVICE].nbytes
        return SnapshotEntry(nbytes=nbytes, source="grid", has_logits=has_logits, handle=handle)

    def attach(self, tokens, page_table: list[int], label, has_logits: bool = False) -> bool:
        """Store and hang a snapshot at len(tokens), as HybridPrefixCache._attach does (freed if one is there)."""
        entry = self.store(label, has_logits)
        if entry is None:
            return False
        if not self.tree.attach_snapshot(tokens, page_table, entry):
            self.tiers.release(entry.handle)
            return False
        return True

    def label(self, entry: SnapshotEntry):
        return self.labels[id(entry.handle)]

    def make_room(self, has_logits: bool = False) -> list:
        """Store one snapshot into a full device tier and let it go: the labels released to make room."""
        pool = self.tiers.device
        budget, pool.budget_bytes = pool.budget_bytes, pool.used_bytes
        before = len(self.released)
        try:
            entry = self.store("probe", has_logits)
        finally:
            pool.budget_bytes = budget
        if entry is not None:
            self.tiers.release(entry.handle)
        return [label for label, _ in self.released[before:]]

    def check(self, held=()) -> None:
        """Tree and tier invariants, and allocator refcounts == tree references + pages a caller holds."""
        self.cache.check_integrity()
        self.alloc.check_integrity(expected_refs=dict(Counter(self.tree.page_refs()) + Counter(held)))
