"""ModelRunner: turns a ScheduledBatch into a ForwardBatch, runs the model, returns logits.

For sequence i scheduled with n new tokens, the step computes positions [num_computed, num_computed + n)
and writes their KV to the pages `page_table[p // page_size]`. Logits are computed only for the
sequences whose last token is among them (prefill finished, or a decode step). The prefix cache says
where inside each prefill segment the recurrent state is to be captured (snapshots mid-chunk).
"""

from __future__ import annotations

import torch

from cairn.cache.base import PrefixCache
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.model.batch import ForwardBatch
from cairn.model.hybrid import HybridModel
from cairn.scheduler import ScheduledBatch
from cairn.sequence import Sequence


class ModelRunner:
    def __init__(self, model: HybridModel, kv: KVPool, states: StatePool, device: torch.device,
                 cache: PrefixCache | None = None):
        self.model = model
        self.kv = kv
        self.states = states
        self.device = device
        self.page_size = kv.page_size
        self.cache = cache  # asked where each prefill segment wants its state captured

    def build(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Sequence]]:
        # decode sequences in slot order, so that consecutive slots are a view of the state pool
        order = sorted(range(batch.num_decode), key=lambda i: batch.seqs[i].state_slot)
        batch.seqs[: batch.num_decode] = [batch.seqs[i] for i in order]
        ids, positions, slots, logits_rows, sampled = [], [], [], [], []
        context_lens, tables, captures, capture_pool = [], [], [], None
        ps = self.page_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.page_table
            slots.extend(table[p // ps] * ps + p % ps for p in range(start, end))
            context_lens.append(end)
            tables.append(table[: -(-end // ps)])
            pool, wanted = self.cache.captures(seq, start, end) if self.cache and n > 1 else (None, [])
            captures.append(wanted)
            capture_pool = pool or capture_pool
            if end == seq.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled.append(seq)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            query_lens=list(batch.num_new_tokens),
            context_lens=context_lens,
            num_decode=batch.num_decode,
            page_tables=torch.tensor(padded, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_slots=torch.tensor([s.state_slot for s in batch.seqs], dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            captures=captures, capture_pool=capture_pool,
        )
        return fb, sampled

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [len(sampled), vocab] (fp32, on CPU) for the sequences that need a next token."""
        fb, sampled = self.build(batch)
        logits = self.model(fb, self.kv, self.states)
        return logits.cpu(), sampled
