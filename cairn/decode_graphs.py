"""DecodeGraphs: a pure decode step as a captured graph per batch bucket (`--cuda-graphs`, off; untested on GPU).

A step of n decode sequences runs in the smallest bucket b >= n of 1, 2, 4, 8, ... up to max_num_seqs,
on static input buffers whose rows past n are padding (n = 3 in bucket 4):

    row              0      1      2    | 3 (padding)
    input_ids        t0     t1     t2   | 0
    positions        p0     p1     p2   | 0
    slot_mapping     kv0    kv1    kv2  | scratch_page * page_size      (KV writes)
    state_slots      s0     s1     s2   | scratch_slot                  (state gathered / scattered)
    context_lens     p0+1   p1+1   p2+1 | 1
    page_tables      pages of each row, then scratch_page to the width of max_model_len / page_size
    logits           l0     l1     l2   | (dropped)

The buffers are allocated once at the largest bucket and bucket b reads their first b rows (views at fixed
addresses). The scratch page and slot are reserved in the pools (PageAllocator.reserve, StatePool.reserve:
never handed to a request), so a padding row writes only there. A bucket is captured on its first use with
every row padding, so the warm-up and capture runs touch nothing but the scratch page and slot; each step
then copies its values into the buffers (two host-to-device copies), replays, and returns the real rows of
the static logits. The step is the model's own forward on a ForwardBatch marked static
(`static_context_lens`): slots by index tensor, context lengths on the device, no host read.

What it is not: the capture itself (a backend: cairn.ops.cuda_graphs.CudaGraphBackend, or the checking
stand-in cairn.ops.graph_check.CheckingGraphBackend), or the eager path (cairn/runner.py), which every
step that is not a pure decode batch of at most max_num_seqs sequences still takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from cairn.forward_batch import ForwardBatch
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.model.hybrid import HybridModel
from cairn.sequence import Sequence

# rows of the [5, max bucket] input buffer, copied in with one copy per step
INPUT_IDS, POSITIONS, SLOT_MAPPING, STATE_SLOTS, CONTEXT_LENS = range(5)


class CaptureBackend(Protocol):
    name: str

    def capture(self, step: Callable[[], torch.Tensor], static: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture `step` (it reads only `static` tensors and what it computes) and return its replay, which
        runs the step on the buffers' current values and returns the step's output tensor of the capture."""


def buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself: [1, 2, 4, 8, 12] for 12."""
    sizes = [1]
    while sizes[-1] * 2 <= max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: HybridModel, kv: KVPool, states: StatePool, backend: CaptureBackend,
                 max_num_seqs: int, max_model_len: int):
        """Reserves the scratch page in `kv` and the scratch slot in `states` (for good)."""
        self.model, self.kv, self.states, self.backend = model, kv, states, backend
        self.scratch_page = kv.allocator.reserve()
        self.scratch_slot = states.reserve()
        self.buckets = buckets(max_num_seqs)
        self.width = -(-max_model_len // kv.page_size)  # page-table columns: the longest sequence's pages
        rows, device = self.buckets[-1], kv.k.device
        self.inputs = torch.zeros(5, rows, dtype=torch.long, device=device)
        self.page_tables = torch.zeros(rows, self.width, dtype=torch.long, device=device)
        self.logits_indices = torch.arange(rows, device=device)
        self.host_context_lens = [1] * rows  # this step's lengths on the host: read by nothing under a graph
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding num_seqs rows, None when there is none (the step runs eagerly)."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Next-token logits [len(seqs), vocab] (fp32, on the device) of one decode step of `seqs` (each with
        exactly one token to compute), in their order; their KV and states are updated like the eager step's."""
        size = self.bucket(len(seqs))
        if size not in self._replays:
            self._fill([], size)  # capture with every row padding: only the scratch page and slot are touched
            self._replays[size] = self.backend.capture(lambda: self._step(size), self._static())
        self._fill(seqs, size)
        return self._replays[size]()[: len(seqs)]

    def _step(self, size: int) -> torch.Tensor:
        """The model on the first `size` rows of the buffers: what is captured."""
        i = self.inputs[:, :size]
        batch = ForwardBatch(
            input_ids=i[INPUT_IDS], positions=i[POSITIONS], query_lens=[1] * size,
            context_lens=self.host_context_lens[:size], num_decode=size, page_tables=self.page_tables[:size],
            slot_mapping=i[SLOT_MAPPING], state_slots=i[STATE_SLOTS], logits_indices=self.logits_indices[:size],
            static_context_lens=i[CONTEXT_LENS])
        return self.model(batch, self.kv, self.states)

    def _fill(self, seqs: list[Sequence], size: int) -> None:
        """Copy the step's values into the first `size` rows, padding rows after the sequences'."""
        ps, scratch = self.kv.page_size, self.scratch_page
        columns, tables = [], []
        for seq in seqs:
            p = seq.num_tokens - 1  # the one new token's position
            columns.append((seq.token_ids[p], p, seq.page_table[p // ps] * ps + p % ps, seq.state_slot, p + 1))
            table = seq.page_table[: p // ps + 1]
            tables.append(table + [scratch] * (self.width - len(table)))
        padding = size - len(seqs)
        columns += [(0, 0, scratch * ps, self.scratch_slot, 1)] * padding
        tables += [[scratch] * self.width] * padding
        values = torch.tensor(columns, dtype=torch.long).t()
        self.inputs[:, :size].copy_(values)
        self.page_tables[:size].copy_(torch.tensor(tables, dtype=torch.long))
        self.host_context_lens[:size] = values[CONTEXT_LENS].tolist()

    def _static(self) -> dict[str, torch.Tensor]:
        """Every tensor a step reads that it does not compute, by name: what the checking backend may accept."""
        static = {"inputs": self.inputs, "page_tables": self.page_tables, "logits_indices": self.logits_indices,
                  "kv.k": self.kv.k, "kv.v": self.kv.v}
        static.update({f"state.{name}": t for name, t in self.states.read_slot(self.scratch_slot).items()})
        static.update({f"weight.{name}": t for name, t in self.model.named_parameters()})
        static.update({f"buffer.{name}": t for name, t in self.model.named_buffers()})
        for module_name, module in self.model.named_modules():  # derived tensors kept as plain attributes
            static.update({f"attribute.{module_name}.{k}": v for k, v in vars(module).items()
                           if isinstance(v, torch.Tensor)})
        return static
