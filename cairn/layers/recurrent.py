"""RecurrentMixer: the one interface of token mixers whose context is a fixed-size state per sequence.

Gated DeltaNet and Mamba2 are both called as `mixer(hidden, batch, states, kernels)`: each declares
its state as named tensors (`state_entries`, which the model's StateSpec is made of), finds its slot
tensors in the state pool by its model layer index (`states.of_layer(self.layer)`), runs the step's
decode sequences as one batch and its prefill segments piece by piece (`prefill_pieces`), and saves its
state at the step's capture positions into the capture pool's slots, without splitting a piece.

What this is not: a kernel (cairn.ops) or the pool (cairn.memory.state_pool).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterator
from itertools import pairwise

import torch
from torch import nn

from cairn.forward_batch import ForwardBatch
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import StateTensor
from cairn.ops import Kernels

# Longest piece of a prefill segment given to the prefill kernels at once. The chunked scans and the conv
# are linear in length, but their fp32 intermediates for a 2048-token chunk (tens of MB per layer)
# outgrow the CPU caches: 1024-token pieces ran 1.3x faster per layer at the Qwen3.5-0.8B shape.
MAX_PIECE = 1024

Captures = list[tuple[int, dict[str, torch.Tensor]]]  # (tokens of the piece before it, the capture slot's tensors)


def pieces(start: int, length: int,
           captures: list[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """How a segment of `length` tokens from absolute position `start` is run: (lo, hi, [(count within the
    piece, capture slot)]), lo and hi offsets in the segment.

    Pieces of at most MAX_PIECE tokens, cut at absolute multiples of MAX_PIECE (so a segment that starts
    at a multiple of 64 keeps the chunked kernels' chunks on absolute multiples of 64), each continuing
    the state of the one before; a capture at offset c (the state after c tokens of the segment) goes to
    the piece that computes it, and the kernels return it without splitting the piece.
    """
    first = (start // MAX_PIECE + 1) * MAX_PIECE - start
    bounds = [0, *range(first, length, MAX_PIECE), length]
    return [(lo, hi, [(c - lo, dst) for c, dst in captures if lo < c <= hi]) for lo, hi in pairwise(bounds)]


class RecurrentMixer(nn.Module, metaclass=ABCMeta):
    """A token mixer with a recurrent state; subclasses set `layer` and implement the two methods below."""

    layer: int  # the model layer index: names this mixer's tensors in the state pool

    @abstractmethod
    def state_entries(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        """This mixer's state per slot, for a model computing in `dtype`."""

    @abstractmethod
    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, states: StatePool, kernels: Kernels) -> torch.Tensor:
        """hidden [T, hidden_size] -> out [T, hidden_size]. Reads and updates the working slots of `states`
        (a StatePool) in place, and writes the captures `batch` asks for into `batch.capture_pool`."""

    def prefill_pieces(self, batch: ForwardBatch) -> Iterator[tuple[slice, int, Captures]]:
        """(token rows, working slot, captures) of each piece of each prefill segment, in order: a piece
        continues the state the one before left in the slot."""
        for i, row, new, context in batch.prefill_segments():
            slot = int(batch.state_slots[i])
            start = context - new  # absolute position of the segment's first token
            for lo, hi, caps in pieces(start, new, [(p - start, dst) for p, dst in batch.captures_of(i)]):
                captures = [(c, {name: t[dst] for name, t in batch.capture_pool.of_layer(self.layer).items()})
                            for c, dst in caps]
                yield slice(row + lo, row + hi), slot, captures
