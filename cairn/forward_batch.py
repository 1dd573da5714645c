"""ForwardBatch: what one model step computes, built by the runner from the scheduler's decision.

A step mixes decode sequences (one new token each) and prefill segments (many new tokens each).
Decode sequences come first so that their tokens form one contiguous, batchable block:

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |
    seqs:      0    1    2    3                4
               <- num_decode ->

For sequence i, `query_lens[i]` tokens are new this step, at absolute positions
[context_lens[i] - query_lens[i], context_lens[i]). A prefill sequence may also ask for its recurrent
state at positions strictly inside its segment (`captures`): the linear layers then save every layer's
state there into slots of `capture_pool` without ending the step, which is how snapshots are taken
mid-chunk at no extra forward pass.

A leaf below model/ and layers/ (it imports only torch): the runner builds it, the model and its layers
read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class SlotTensors(Protocol):
    """What a step needs of the pool that captured states go to (cairn.memory.state_pool.StatePool)."""

    def of_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Model layer `layer`'s state tensors by name, each [num_slots, *shape], written in place."""


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long: the new tokens of every sequence, flattened
    positions: torch.Tensor  # [T] long: absolute position of each new token
    query_lens: list[int]  # per sequence: new tokens this step
    context_lens: list[int]  # per sequence: tokens in its context after this step (cached + new)
    num_decode: int  # the first num_decode sequences each have exactly one new token
    page_tables: torch.Tensor  # [B, max_pages] long: KV page ids per sequence, padded with 0
    slot_mapping: torch.Tensor  # [T] long: flat KV index (page * page_size + offset) of each new token
    state_slots: torch.Tensor  # [B] long: working state slot of each sequence
    logits_indices: torch.Tensor  # [N] long: token rows whose next-token logits are wanted
    captures: list[list[tuple[int, int]]] = field(default_factory=list)  # per sequence: (absolute position
    # strictly inside its segment, slot of capture_pool) where every linear layer saves its state
    capture_pool: SlotTensors | None = None  # where captured states go (the cache's device snapshot pool)
    # set by the CUDA graph path (cairn/decode_graphs.py) only: a pure decode batch of static device buffers,
    # this tensor [num_decode] long being its context lengths. Nothing then reads a value on the host:
    # decode_slots() is the index tensor (gathered and scattered, never a slice chosen from the slot values)
    # and decode_context_lens() is this tensor (the list context_lens is not read).
    static_context_lens: torch.Tensor | None = None
    # computed once per step by the first layer that asks, not once per layer
    _decode_slots: slice | torch.Tensor | None = field(default=None, init=False, repr=False)
    _decode_context_lens: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def decode_slots(self) -> slice | torch.Tensor:
        """The decode sequences' state slots: a slice when they are consecutive and ascending (indexing the
        pool with it gives a view, updated in place), else the index tensor (a gathered copy)."""
        if self.static_context_lens is not None:
            return self.state_slots[: self.num_decode]
        if self._decode_slots is None:
            slots = self.state_slots[: self.num_decode]
            first = int(slots[0])
            if torch.equal(slots, torch.arange(first, first + self.num_decode, device=slots.device)):
                slots = slice(first, first + self.num_decode)
            self._decode_slots = slots
        return self._decode_slots

    def decode_context_lens(self) -> torch.Tensor:
        if self.static_context_lens is not None:
            return self.static_context_lens
        if self._decode_context_lens is None:
            self._decode_context_lens = torch.tensor(self.context_lens[: self.num_decode], dtype=torch.long,
                                                     device=self.input_ids.device)
        return self._decode_context_lens

    def captures_of(self, i: int) -> list[tuple[int, int]]:
        return self.captures[i] if i < len(self.captures) else []

    def prefill_segments(self):
        """(seq index, first token row, new tokens, context length) of each prefill sequence."""
        row = self.num_decode
        for i in range(self.num_decode, self.num_seqs):
            yield i, row, self.query_lens[i], self.context_lens[i]
            row += self.query_lens[i]
