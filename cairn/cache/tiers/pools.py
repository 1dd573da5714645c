"""Snapshot and KV storage of the device and host tiers.

A snapshot tier stores copies of working state slots (every linear layer's conv and recurrent state)
plus, optionally, the next-token logits at that position, under a byte budget it never exceeds.
The device and host tiers are the same `PoolSnapshotTier` over a preallocated slot pool, on the
model's device or in host RAM (page-locked when the device is CUDA). `HostKVBank` is the host's bank
of KV pages, laid out like the device KV pool.

Copies are synchronous: a store has finished when it returns (on CUDA a device-to-host copy blocks
the engine thread; overlapping it with the model step would need a side stream and an event per
copy, published after the step). Restoring copies out and never consumes the stored copy (DESIGN
invariant 2). Tiers know nothing of the radix tree or scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


class PoolSnapshotTier:
    """Snapshots in a preallocated slot pool (on `device`), within `budget_bytes`."""

    def __init__(self, name: str, working: StatePool, budget_bytes: int, vocab_size: int,
                 device: torch.device | str, pin_memory: bool = False):
        self.name = name
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

    def store(self, src: StatePool, slot: int, logits: torch.Tensor | None) -> StoredSnapshot | None:
        """A copy of src[slot] (and logits) in a slot of this tier; None when it does not fit."""
        stored = self.reserve(logits is not None)
        if stored is None:
            return None
        src.copy_to(slot, self.pool, stored.slot)  # synchronous; a CUDA side stream would go here
        if logits is not None:
            stored.logits = logits.to(self.device, torch.float32, copy=True)
        return stored

    def reserve(self, with_logits: bool = False) -> StoredSnapshot | None:
        """A slot (and its bytes) set aside for a state to be written there; None when full."""
        if not self.fits(with_logits):
            return None
        nbytes = self.snapshot_bytes(with_logits)
        self.used_bytes += nbytes
        return StoredSnapshot(self.name, self.pool.alloc(zero=False), None, nbytes)

    def restore(self, snap: StoredSnapshot, dst: StatePool, slot: int) -> torch.Tensor | None:
        """Copy the snapshot into dst[slot] (synchronously); returns a copy of its logits. It stays stored."""
        self.pool.copy_to(snap.slot, dst, slot)
        return None if snap.logits is None else snap.logits.to(dst.device, copy=True)

    def free(self, snap: StoredSnapshot) -> None:
        self.pool.free(snap.slot)
        self.used_bytes -= snap.nbytes


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
        self.budget_bytes = budget_bytes

    @property
    def used_bytes(self) -> int:
        return (self.allocator.num_pages - self.allocator.num_free) * self.bytes_per_page

    def copy_in(self, kv: KVPool, device_pages: list[int]) -> list[int] | None:
        """Host pages holding copies of the device pages (synchronously); None when the bank is full."""
        if len(device_pages) > self.allocator.num_free:
            return None
        host_pages = self.allocator.alloc(len(device_pages))
        src = torch.tensor(device_pages, device=kv.k.device)
        dst = torch.tensor(host_pages)
        self.k[:, dst] = kv.k[:, src].to("cpu")
        self.v[:, dst] = kv.v[:, src].to("cpu")
        return host_pages
