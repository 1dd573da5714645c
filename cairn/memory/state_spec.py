"""StateSpec: a model's recurrent state as named per-layer tensors, each with its shape and dtype per slot.

A recurrent layer (Gated DeltaNet, Mamba2) carries a fixed-size state from token to token; its mixer
declares that state as a few named tensors (`StateTensor`). A model's spec lists, for each recurrent
layer, its model layer index and those tensors, and gives each a name unique in the model:

    layer 0, Gated DeltaNet:  conv [conv_dim, K-1] (model dtype)   recurrent [v_heads, k_dim, v_dim] (fp32)
    layer 3, Mamba2:          conv [conv_dim, K-1] (model dtype)   ssm [heads, head_dim, state_size] (fp32)
    names:                    "layer0.conv"  "layer0.recurrent"  "layer3.conv"  "layer3.ssm"

The state pool, the snapshot tiers and the disk segments are generic over it: nothing below the model
knows what a conv or an SSM state is. `groups()` says which tensors share a shape and dtype, so a pool
stacks them into one tensor and copies a slot in a few large copies. Imports only torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateTensor:
    """One named tensor of one layer's state, as held per slot (per sequence)."""

    name: str  # unique within its layer, e.g. "conv"; no "."
    shape: tuple[int, ...]  # per slot
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class LayerState:
    """The state of one recurrent layer of the model."""

    layer: int  # the model's layer index
    tensors: tuple[StateTensor, ...]


@dataclass(frozen=True)
class StateGroup:
    """Tensors of equal shape and dtype, which a pool stacks into one [len(members), num_slots, *shape]."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    members: tuple[tuple[int, str], ...]  # (model layer, tensor name), in stacking order


@dataclass(frozen=True)
class StateSpec:
    """Every recurrent layer's state, in model layer order."""

    layers: tuple[LayerState, ...]

    def __post_init__(self):
        indices = [s.layer for s in self.layers]
        if indices != sorted(set(indices)):
            raise ValueError(f"state layers must be distinct and in order, got {indices}")
        for s in self.layers:
            names = [t.name for t in s.tensors]
            if len(set(names)) != len(names) or any("." in n or not n for n in names):
                raise ValueError(f"layer {s.layer}: state tensor names must be distinct, non-empty, without '.'")

    @staticmethod
    def key(layer: int, name: str) -> str:
        """The tensor's name in the whole model, as read_slot and disk segments use it: "layer3.conv"."""
        return f"layer{layer}.{name}"

    def tensors(self) -> list[tuple[str, int, StateTensor]]:
        """(key, model layer, tensor) of every state tensor, in layer order."""
        return [(self.key(s.layer, t.name), s.layer, t) for s in self.layers for t in s.tensors]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: every tensor of every layer."""
        return sum(t.nbytes for _, _, t in self.tensors())

    def groups(self) -> list[StateGroup]:
        """The tensors grouped by (shape, dtype), groups in order of first appearance."""
        members: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[int, str]]] = {}
        for _, layer, t in self.tensors():
            members.setdefault((tuple(t.shape), t.dtype), []).append((layer, t.name))
        return [StateGroup(shape, dtype, tuple(m)) for (shape, dtype), m in members.items()]
