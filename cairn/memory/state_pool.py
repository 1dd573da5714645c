"""Pools of recurrent-state slots, laid out from the model's StateSpec.

A slot is one sequence's whole recurrent state at one position: every tensor of every recurrent layer.
The spec's tensors of equal shape and dtype are stacked into one tensor per group,

    group g:  [len(g.members), num_slots, *g.shape]   (g.dtype)

so that for a Gated DeltaNet model the pool is two tensors, every layer's conv states and every layer's
fp32 recurrent states, and copying a slot is one copy per group whatever the number of layers. A layer
finds its own tensors with `of_layer(layer)` (views [num_slots, *shape], updated in place); the cache
sees a slot only as named tensors (`read_slot` / `write_slot`, names as StateSpec.key gives them) and
whole-slot copies (`copy_to`).

A running request computes in its own working slot; a snapshot is a copy of a slot in another pool
(the cache's), made without a model call.
"""

from __future__ import annotations

import torch

from cairn.memory.state_spec import StateSpec


class OutOfSlots(RuntimeError):
    """No free slot in the pool."""


class StatePool:
    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device | str = "cpu", pin_memory: bool = False):
        self.spec = spec
        self._specs = groups = spec.groups()
        # Uninitialised: alloc() zeroes a working slot, and a snapshot slot is always copied into first.
        self._groups = [torch.empty((len(g.members), num_slots, *g.shape), dtype=g.dtype, device=device,
                                    pin_memory=pin_memory) for g in groups]
        self._layers: dict[int, dict[str, torch.Tensor]] = {}  # model layer -> name -> [num_slots, *shape]
        for g, stacked in zip(groups, self._groups, strict=True):
            for i, (layer, name) in enumerate(g.members):
                self._layers.setdefault(layer, {})[name] = stacked[i]
        self._num_slots = num_slots
        self._device = torch.empty(0, device=device).device
        self._pinned = pin_memory
        self._free = list(range(num_slots - 1, -1, -1))
        self.reserved: list[int] = []  # slots out of circulation for good (reserve)

    @classmethod
    def like(cls, other: StatePool, num_slots: int, device: torch.device | str, pin_memory: bool = False) -> StatePool:
        """An empty pool with the same spec (per-slot layout) as `other`."""
        return cls(other.spec, num_slots, device, pin_memory)

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.slot_bytes

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_pinned(self) -> bool:
        return self._pinned

    def alloc(self, zero: bool = True) -> int:
        """A free slot; zeroed (the state before any token) unless the caller overwrites it at once."""
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        if zero:
            for stacked in self._groups:
                stacked[:, slot].zero_()
        return slot

    def reserve(self) -> int:
        """A slot taken out of circulation for good (the CUDA graph path's scratch slot, which padding rows
        read and write): never handed out again, never freed (free raises). Raises OutOfSlots when none is free."""
        slot = self.alloc()
        self.reserved.append(slot)
        return slot

    @property
    def num_usable(self) -> int:
        """Slots that requests can hold: all but the reserved ones."""
        return self._num_slots - len(self.reserved)

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots or slot in self.reserved:
            raise AssertionError(f"free of slot {slot} that is not allocated")
        self._free.append(slot)

    def of_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Model layer `layer`'s state tensors by name, each a view [num_slots, *shape] into the pool."""
        return self._layers[layer]

    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """Slot `slot` as named tensors ("layer3.conv": a view [*shape] into the pool): what a snapshot stores."""
        key = self.spec.key
        return {key(layer, name): t[slot] for layer, named in self._layers.items() for name, t in named.items()}

    def write_slot(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """self[slot] <- tensors (named as read_slot names them, each of its shape; copied, converted to the
        pool's device and dtypes). Raises ValueError when a tensor is missing or misshapen.

        A group's tensors that lie evenly spaced in one buffer (a snapshot read from disk: every layer's
        conv and recurrent state, alternating) are copied as one strided tensor, one copy per group."""
        key = self.spec.key
        for group, stacked in zip(self._specs, self._groups, strict=True):
            sources = [tensors.get(key(layer, name)) for layer, name in group.members]
            for (layer, name), src in zip(group.members, sources, strict=True):
                if src is None or src.shape != group.shape:
                    raise ValueError(f"state tensor {key(layer, name)}: expected shape {group.shape}, got "
                                     f"{None if src is None else tuple(src.shape)}")
            whole = _evenly_spaced(sources)
            if whole is not None:
                stacked[:, slot].copy_(whole)
            else:
                for dst, src in zip(stacked[:, slot], sources, strict=True):
                    dst.copy_(src)

    def copy_to(self, src: int, dst_pool: StatePool, dst: int, non_blocking: bool = False) -> None:
        """dst_pool[dst] <- self[src], every layer (dst_pool has the same spec); the source is left untouched."""
        if dst_pool.spec is not self.spec and dst_pool.spec != self.spec:
            raise ValueError("copy between state pools of different specs")
        for mine, theirs in zip(self._groups, dst_pool._groups, strict=True):
            theirs[:, dst].copy_(mine[:, src], non_blocking=non_blocking)


def _evenly_spaced(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one strided view [len(tensors), *shape] when they are contiguous, of one dtype, and
    evenly spaced in one storage (tensor i at the first's address + i * step); None otherwise."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
               and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in tensors):
        return None
    step = tensors[1].storage_offset() - first.storage_offset() if len(tensors) > 1 else first.numel()
    if step < first.numel() or any(t.storage_offset() != first.storage_offset() + i * step
                                   for i, t in enumerate(tensors)):
        return None
    return first.as_strided((len(tensors), *first.shape), (step, *first.stride()))
