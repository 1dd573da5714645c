"""ModelRunner: turns a ScheduledBatch into a ForwardBatch, runs the model, returns logits.

For sequence i scheduled with n new tokens, the step computes positions [num_computed, num_computed + n)
and writes their KV to the pages `page_table[p // page_size]`. Logits are computed only for the
sequences whose last token is among them (prefill finished, or a decode step). The batch says where
inside each prefill segment the recurrent state is to be captured (snapshots mid-chunk: the scheduler
asked the prefix cache); the runner never calls the cache.

With a `prefill_block` (exact resumption) the step runs as several model calls: one for the decode
sequences, then one per block of each prefill chunk, the blocks cut at absolute multiples of the block:

    chunk [320, 1100), block 512:   [320, 512)  [512, 1024)  [1024, 1100)      three calls

Every matrix product of a prefill token then has the same shape (and the token the same row in it)
whether the request resumed from the cache or not, and whatever else is in the step, so its logits,
KV and states are bit for bit those of a cold run: the kernels' results depend on the shapes of the
products (a GEMM picks its blocking by size), not only on each row's values.

With `graphs` (`--cuda-graphs`) a pure decode step with nothing to capture replays a graph captured for its
batch bucket instead (cairn/decode_graphs.py); every other step runs as above.
"""

from __future__ import annotations

import torch

from cairn.decode_graphs import DecodeGraphs
from cairn.forward_batch import ForwardBatch
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.model.hybrid import HybridModel
from cairn.scheduler import ScheduledBatch
from cairn.sequence import Sequence

Item = tuple[Sequence, int, int, list[tuple[int, int]]]  # (seq, first position, new tokens, captures)


class ModelRunner:
    def __init__(self, model: HybridModel, kv: KVPool, states: StatePool, device: torch.device,
                 prefill_block: int = 0, graphs: DecodeGraphs | None = None):
        self.model = model
        self.kv = kv
        self.states = states
        self.device = device
        self.page_size = kv.page_size
        self.prefill_block = prefill_block  # 0: one call per step; else one call per block (see above)
        self.graphs = graphs  # --cuda-graphs: pure decode steps replay a captured graph (cairn/decode_graphs.py)

    def takes_graph(self, batch: ScheduledBatch) -> bool:
        """A pure decode step of at most the largest bucket's sequences, with nothing to capture."""
        return (self.graphs is not None and batch.num_decode == len(batch.seqs) and not batch.captures
                and self.graphs.bucket(batch.num_decode) is not None)

    def build(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Sequence]]:
        """The whole step as one model call."""
        self._order_decode(batch)
        items = [(seq, seq.num_computed, n, batch.captures.get(seq.request_id, []))
                 for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
        return self._build(items, batch.num_decode, batch.capture_pool if batch.captures else None)

    @staticmethod
    def _order_decode(batch: ScheduledBatch) -> None:
        """Decode sequences in slot order, so that consecutive slots are a view of the state pool."""
        order = sorted(range(batch.num_decode), key=lambda i: batch.seqs[i].state_slot)
        batch.seqs[: batch.num_decode] = [batch.seqs[i] for i in order]

    def _calls(self, batch: ScheduledBatch) -> list[tuple[list[Item], int, StatePool | None]]:
        """(items, num_decode, capture pool) per model call with a prefill block: the decode sequences, then
        each block. A capture at a block's last position goes to that block (the state it ends with)."""
        self._order_decode(batch)
        nd, block = batch.num_decode, self.prefill_block
        calls = [([(seq, seq.num_computed, 1, []) for seq in batch.seqs[:nd]], nd, None)] if nd else []
        for seq, n in zip(batch.seqs[nd:], batch.num_new_tokens[nd:], strict=True):
            start, end = seq.num_computed, seq.num_computed + n
            pool, wanted = batch.capture_pool, batch.captures.get(seq.request_id, [])
            cuts = range((start // block + 1) * block, end, block)
            for lo, hi in zip([start, *cuts], [*cuts, end], strict=True):
                mine = [(p, slot) for p, slot in wanted if lo < p <= hi]
                calls.append(([(seq, lo, hi - lo, mine)], 0, pool if mine else None))
        return calls

    def _build(self, items: list[Item], num_decode: int,
               capture_pool: StatePool | None) -> tuple[ForwardBatch, list[Sequence]]:
        """One model call computing tokens [start, start + n) of each (seq, start, n, captures), decode first."""
        ids, positions, slots, logits_rows, sampled = [], [], [], [], []
        context_lens, tables = [], []
        ps = self.page_size
        for seq, start, n, _ in items:
            end = start + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.page_table
            slots.extend(table[p // ps] * ps + p % ps for p in range(start, end))
            context_lens.append(end)
            tables.append(table[: -(-end // ps)])
            if end == seq.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled.append(seq)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            query_lens=[n for _, _, n, _ in items],
            context_lens=context_lens,
            num_decode=num_decode,
            page_tables=torch.tensor(padded, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_slots=torch.tensor([seq.state_slot for seq, _, _, _ in items], dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            captures=[wanted for _, _, _, wanted in items], capture_pool=capture_pool,
        )
        return fb, sampled

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [len(sampled), vocab] (fp32, on CPU) for the sequences that need a next token."""
        if self.takes_graph(batch):
            seqs = list(batch.seqs)
            return self.graphs.run(seqs).cpu(), seqs
        if not self.prefill_block:
            fb, sampled = self.build(batch)
            return self.model(fb, self.kv, self.states).cpu(), sampled
        outs, sampled = [], []
        for items, num_decode, pool in self._calls(batch):
            fb, wanted = self._build(items, num_decode, pool)
            outs.append(self.model(fb, self.kv, self.states).cpu())
            sampled += wanted
        return torch.cat(outs), sampled
