"""The page tiers (`PageTier`, tiers/base.py): the device and host tiers, preallocated pools of snapshot slots
and KV pages.

A page tier stores copies of working state slots (every linear layer's state, as StatePool names
it) plus, optionally, the next-token logits at that position, under a byte budget it never exceeds,
and copies of nodes' KV in its page pool. `PoolTier` is what both share; the two differ in who writes
them:

    DeviceTier  the first tier, over the engine's KVPool: requests write it (their pages, which the tree
                shares; `store` / `reserve` of a working slot's state), and nothing is stored into it
    HostTier    a tier below (a `LowerTier`): demotion stores a node's snapshot and KV into it from their
                fastest copy, into a `HostKVBank` laid out like the device pool (page-locked on CUDA)

Copies are synchronous: a store has finished when it returns (on CUDA a device-to-host copy blocks
the engine thread; overlapping it with the model step would need a side stream and an event per
copy, published after the step). Restoring copies out and never consumes the stored copy (DESIGN
invariant 2). Tiers know nothing of the radix tree's structure or of the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cairn.cache.tiers.base import KV, Source, State
from cairn.cache.tree.nodes import DEVICE, HOST, Node
from cairn.memory.kv_pool import KVPool
from cairn.memory.pages import PageAllocator
from cairn.memory.state_pool import StatePool


@dataclass
class StoredSnapshot:
    """One tier's copy of one snapshot."""

    tier: str  # name of the tier holding it
    slot: int  # the slot in the tier's pool
    logits: torch.Tensor | None  # next-token logits at the snapshot position, when stored
    nbytes: int  # bytes it takes in the tier (state slot + logits)


class PoolTier:
    """Snapshots in a preallocated slot pool (on `device`) within `budget_bytes`, and KV in `kv`'s pages."""

    write_through = False

    def __init__(self, name: str, working: StatePool, budget_bytes: int, vocab_size: int,
                 device: torch.device | str, kv: KVPool | HostKVBank, bandwidth: float, pin_memory: bool = False):
        self.name, self.kv, self.bandwidth = name, kv, bandwidth
        self.pages = kv.allocator
        self._slot_bytes = working.bytes_per_slot
        self._logits_bytes = 4 * vocab_size
        self.budget_bytes = budget_bytes
        self.pool = StatePool.like(working, budget_bytes // self._slot_bytes, device, pin_memory)
        self.used_bytes = 0
        self.device = torch.device(device)

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def snapshot_bytes(self, with_logits: bool) -> int:
        return self._slot_bytes + (self._logits_bytes if with_logits else 0)

    def fits(self, with_logits: bool) -> bool:
        return self.pool.num_free > 0 and self.used_bytes + self.snapshot_bytes(with_logits) <= self.budget_bytes

    def reserve(self, with_logits: bool = False) -> StoredSnapshot | None:
        """A slot (and its bytes) set aside for a state to be written there; None when full."""
        if not self.fits(with_logits):
            return None
        nbytes = self.snapshot_bytes(with_logits)
        self.used_bytes += nbytes
        return StoredSnapshot(self.name, self.pool.alloc(zero=False), None, nbytes)

    def _keep_logits(self, stored: StoredSnapshot, logits: torch.Tensor | None) -> None:
        if logits is not None:
            stored.logits = logits.to(self.device, torch.float32, copy=True)

    def load_snapshot(self, copy: StoredSnapshot, dst: StatePool, slot: int) -> torch.Tensor | None:
        """Copy the snapshot into dst[slot] (synchronously); returns a copy of its logits. It stays stored."""
        self.pool.copy_to(copy.slot, dst, slot)
        return None if copy.logits is None else copy.logits.to(dst.device, copy=True)

    def read_snapshot(self, copy: StoredSnapshot) -> State:
        return self.pool.read_slot(copy.slot), copy.logits

    def free_snapshot(self, copy: StoredSnapshot) -> None:
        self.pool.free(copy.slot)
        self.used_bytes -= copy.nbytes

    def read_kv(self, node: Node) -> KV:
        return self.kv.read_pages(node.kv[self.name])


class DeviceTier(PoolTier):
    """The first tier: snapshots of requests' working slots, and the engine's KV pool, whose pages requests
    write and the tree shares. Nothing is above it, so nothing is stored into it from a `Source`."""

    kv: KVPool

    def __init__(self, working: StatePool, budget_bytes: int, vocab_size: int, kv: KVPool, bandwidth: float):
        super().__init__(DEVICE, working, budget_bytes, vocab_size, working.device, kv, bandwidth)

    def store(self, src: StatePool, slot: int, logits: torch.Tensor | None) -> StoredSnapshot | None:
        """A copy of src[slot] (and logits) in a slot of this tier; None when it does not fit."""
        stored = self.reserve(logits is not None)
        if stored is None:
            return None
        src.copy_to(slot, self.pool, stored.slot)  # synchronous; a CUDA side stream would go here
        self._keep_logits(stored, logits)
        return stored


class HostTier(PoolTier):
    """A page tier below the device (a `LowerTier`) in host RAM: what demotion stores into it, read from a
    `Source`."""

    kv: HostKVBank

    def __init__(self, working: StatePool, budget_bytes: int, vocab_size: int, kv: HostKVBank, bandwidth: float,
                 pin_memory: bool = False):
        super().__init__(HOST, working, budget_bytes, vocab_size, "cpu", kv, bandwidth, pin_memory)

    def store_snapshot(self, node: Node, source: Source) -> StoredSnapshot | None:
        """A copy of node's snapshot; None when the tier is full. Only demotion from the device stores here, and a
        device copy is always readable (only a segment can turn out unreadable, and segment tiers are below)."""
        tensors, logits = source.node_snapshot(node)
        stored = self.reserve(logits is not None)
        if stored is None:
            return None
        self.pool.write_slot(stored.slot, tensors)  # synchronous; a CUDA side stream would go here
        self._keep_logits(stored, logits)
        return stored

    def kv_fits(self, num_pages: int) -> bool:
        return self.pages.num_free >= num_pages

    def store_kv(self, node: Node, source: Source) -> list[int] | None:
        """Fresh pages holding a copy of node's KV (the caller hands their references to the tree)."""
        kv = source.node_kv(node)
        if kv is None or not self.kv_fits(kv[0].shape[1]):
            return None
        pages = self.pages.alloc(kv[0].shape[1])
        self.kv.write_pages(pages, *kv)
        return pages

    def read_page(self, node: Node, i: int, cache: dict) -> KV:
        page = node.kv[self.name][i]
        return self.kv.k[:, page], self.kv.v[:, page]


class HostKVBank:
    """KV pages in host RAM, laid out like the device pool, with their own allocator and budget."""

    def __init__(self, like: KVPool, budget_bytes: int, pin_memory: bool = False):
        num_pages = budget_bytes // like.bytes_per_page
        layers, _, page_size, heads, dim = like.k.shape
        shape = (layers, num_pages, page_size, heads, dim)
        # empty, not zeros: every page is written before it is read, and an untouched page costs no RAM
        self.k = torch.empty(shape, dtype=like.k.dtype, pin_memory=pin_memory)
        self.v = torch.empty(shape, dtype=like.v.dtype, pin_memory=pin_memory)
        self.allocator = PageAllocator(num_pages)
        self.bytes_per_page = like.bytes_per_page

    @property
    def used_bytes(self) -> int:
        return (self.allocator.num_pages - self.allocator.num_free) * self.bytes_per_page

    def read_pages(self, pages: list[int]) -> KV:
        index = torch.tensor(pages, dtype=torch.long)
        return self.k[:, index], self.v[:, index]

    def write_pages(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        index = torch.tensor(pages, dtype=torch.long)
        self.k[:, index] = k.to("cpu", self.k.dtype)
        self.v[:, index] = v.to("cpu", self.v.dtype)
