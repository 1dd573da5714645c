"""Pools of recurrent-state slots: every Gated DeltaNet layer's conv state and recurrent state.

Layout, one tensor each:

    conv:      [num_linear_layers, num_slots, conv_dim, kernel - 1]       (model dtype)
    recurrent: [num_linear_layers, num_slots, v_heads, k_head_dim, v_head_dim]  (fp32)

A slot is a sequence's whole recurrent state at one position. A running request computes in its own
working slot; a snapshot is a copy of a slot in another pool (the cache's). Copying a slot is a plain
tensor copy over the layer dimension, with no model call.
"""

from __future__ import annotations

import torch


class OutOfSlots(RuntimeError):
    """No free slot in the pool."""


class StatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, v_heads: int,
                 k_head_dim: int, v_head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 pin_memory: bool = False):
        # Uninitialised: alloc() zeroes a working slot, and a snapshot slot is always copied into first.
        self.conv = torch.empty((num_layers, num_slots, conv_dim, conv_kernel - 1), dtype=dtype, device=device,
                                pin_memory=pin_memory)
        self.recurrent = torch.empty((num_layers, num_slots, v_heads, k_head_dim, v_head_dim),
                                     dtype=torch.float32, device=device, pin_memory=pin_memory)
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def slot_bytes(num_layers: int, conv_dim: int, conv_kernel: int, v_heads: int, k_head_dim: int,
                   v_head_dim: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        conv = conv_dim * (conv_kernel - 1) * itemsize
        return num_layers * (conv + v_heads * k_head_dim * v_head_dim * 4)

    @classmethod
    def like(cls, other: StatePool, num_slots: int, device: torch.device | str, pin_memory: bool = False) -> StatePool:
        """An empty pool with the same per-slot layout as `other`."""
        layers, _, conv_dim, k_minus_1 = other.conv.shape
        _, _, heads, dk, dv = other.recurrent.shape
        return cls(layers, num_slots, conv_dim, k_minus_1 + 1, heads, dk, dv, other.conv.dtype, device, pin_memory)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.recurrent[:, 0].numel() * self.recurrent.element_size())

    def alloc(self, zero: bool = True) -> int:
        """A free slot; zeroed (the state before any token) unless the caller overwrites it at once."""
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        if zero:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise AssertionError(f"free of slot {slot} that is not allocated")
        self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    @property
    def device(self) -> torch.device:
        return self.conv.device

    @property
    def is_pinned(self) -> bool:
        return self.conv.is_pinned()

    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """Slot `slot` as named tensors (views into the pool, every layer): what a snapshot stores."""
        return {"conv": self.conv[:, slot], "recurrent": self.recurrent[:, slot]}

    def write_slot(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """self[slot] <- tensors (as read_slot names them; copied, converted to the pool's device and dtypes)."""
        for name, dst in self.read_slot(slot).items():
            dst.copy_(tensors[name].to(dst.device, dst.dtype))

    def copy_to(self, src: int, dst_pool: StatePool, dst: int, non_blocking: bool = False) -> None:
        """dst_pool[dst] <- self[src], every layer; the source is left untouched."""
        dst_pool.conv[:, dst].copy_(self.conv[:, src], non_blocking=non_blocking)
        dst_pool.recurrent[:, dst].copy_(self.recurrent[:, src], non_blocking=non_blocking)
