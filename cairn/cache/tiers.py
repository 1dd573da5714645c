"""Snapshot tiers: where a snapshot's bytes live. This module holds the interface and the device tier.

A tier stores copies of working state slots (every linear layer's conv and recurrent state) plus,
optionally, the next-token logits at that position, under a byte budget it never exceeds. Storing and
restoring are copies; restoring never consumes the stored snapshot (DESIGN invariant 2). Tiers know
nothing of the radix tree or the scheduler: the cache decides what to store, evict and restore.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from cairn.memory.state_pool import StatePool


@dataclass
class StoredSnapshot:
    """A tier's record of one snapshot (the handle the radix tree carries, opaque to it)."""

    tier: str  # name of the tier holding it
    slot: int  # the slot in the tier's pool
    logits: torch.Tensor | None  # next-token logits at the snapshot position, when stored
    nbytes: int  # bytes it takes in the tier (state slot + logits)


class SnapshotTier(ABC):
    name: str

    @property
    @abstractmethod
    def budget_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def snapshot_bytes(self, with_logits: bool) -> int:
        """Bytes a snapshot of this model takes here."""

    @abstractmethod
    def store(self, src: StatePool, slot: int, logits: torch.Tensor | None) -> StoredSnapshot | None:
        """Copy src[slot] (and the logits) into the tier; None when it does not fit now."""

    @abstractmethod
    def restore(self, snap: StoredSnapshot, dst: StatePool, slot: int) -> torch.Tensor | None:
        """Copy the snapshot into dst[slot]; returns a copy of its logits (or None). The snapshot stays."""

    @abstractmethod
    def free(self, snap: StoredSnapshot) -> None:
        """Release the snapshot's space. Safe to call once per stored snapshot."""


class DeviceSnapshotTier(SnapshotTier):
    """Snapshots in a preallocated slot pool on the model's device, within `budget_bytes`."""

    name = "device"

    def __init__(self, working: StatePool, budget_bytes: int, vocab_size: int):
        self._slot_bytes = working.bytes_per_slot
        self._logits_bytes = 4 * vocab_size
        self._budget = budget_bytes
        num_slots = budget_bytes // self._slot_bytes
        self.pool = StatePool.like(working, num_slots, working.conv.device)
        self._used = 0

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def snapshot_bytes(self, with_logits: bool) -> int:
        return self._slot_bytes + (self._logits_bytes if with_logits else 0)

    def store(self, src: StatePool, slot: int, logits: torch.Tensor | None) -> StoredSnapshot | None:
        nbytes = self.snapshot_bytes(logits is not None)
        if self.pool.num_free == 0 or self._used + nbytes > self._budget:
            return None
        dst = self.pool.alloc(zero=False)
        src.copy_to(slot, self.pool, dst)
        kept = None if logits is None else logits.detach().float().to(self.pool.conv.device, copy=True)
        self._used += nbytes
        return StoredSnapshot(self.name, dst, kept, nbytes)

    def restore(self, snap: StoredSnapshot, dst: StatePool, slot: int) -> torch.Tensor | None:
        self.pool.copy_to(snap.slot, dst, slot)
        return None if snap.logits is None else snap.logits.clone()

    def free(self, snap: StoredSnapshot) -> None:
        self.pool.free(snap.slot)
        self._used -= snap.nbytes
