"""Scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step (`schedule`) picks, in order:
1. every running sequence in decode: one token each; a sequence that needs a new KV page and finds
   none preempts the most recently admitted running sequence (its pages and slot are released and it
   returns to the front of the queue to be recomputed);
2. running sequences still in prefill: a chunk each, within the remaining budget, ending at the end of
   the tokens at the latest (snapshots inside a chunk are captured by the step itself); with a
   `prefill_block` (exact resumption) a chunk also ends only at a multiple of the block or at the end
   of the tokens, never inside a block, so its blocks are the same whatever the budget left. When the
   step also decodes, a chunk deep in a long prompt costs the budget its attention work too (position p:
   1 + p / `attention_break_even` budget tokens per token, at least one block), so that a step beside
   streams lasts about as long at position 50K as at 0 instead of growing with the prompt's depth;
3. waiting sequences, first come first served, while the budget, a working state slot and KV pages
   for the whole remaining prompt are available. The prefix cache plans each admission (where to
   resume, which snapshots to take) and may evict to make room; it returns an `Admission`, which the
   scheduler applies to the sequence. A resume that does not fit the pool while nothing runs never will
   (nothing is left to free but the cached path it holds): the sequence is admitted from position 0
   instead, without the cache (a prompt within a few pages of the pool's size).
Then it asks the cache where each prefill chunk saves its state mid-chunk (the batch's captures).

After the runner computed the batch, `after_step` applies it: computed counts, the cache told (it
takes and publishes snapshots), the logits restored at admission joined to the computed ones. Each
sampled token goes through `append` (stop token, length), and `finish` ends a sequence.

The scheduler is the only caller of the prefix cache in a request's steps, and it owns page and slot bookkeeping for
running sequences; it never runs the model. Its output is a `ScheduledBatch`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from cairn.cache.base import Admission, CacheRequest, PrefixCache
from cairn.cache.stats import CacheStats
from cairn.errors import QueueFull, RequestTooLarge
from cairn.memory.pages import PageAllocator
from cairn.memory.state_pool import StatePool
from cairn.sequence import Sequence, Status

log = logging.getLogger(__name__)


class SequenceFailed(RuntimeError):
    """Scheduling one sequence raised (its __cause__); the sequence holds no slot, page or cache lock."""

    def __init__(self, seq: Sequence):
        super().__init__(f"scheduling {seq.request_id} failed")
        self.seq = seq


@dataclass
class ScheduledBatch:
    """One step's work: decode sequences first (one token each), then prefill chunks."""

    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens computed this step
    num_decode: int  # how many of `seqs` (from the front) are decode steps
    preempted: list[Sequence]  # sequences sent back to the queue by this step
    ready: list[Sequence] = field(default_factory=list)  # admitted with their next-token logits restored
    # request id -> [(position, slot)]: where a prefill chunk saves its recurrent state strictly inside the
    # chunk (slots of capture_pool, reserved by the cache until after_step); absent: nowhere
    captures: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    capture_pool: StatePool | None = None

    @property
    def empty(self) -> bool:
        return not self.seqs and not self.ready

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, pages: PageAllocator, page_size: int, states: StatePool, cache: PrefixCache,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, max_waiting: int,
                 prefill_block: int = 0, attention_break_even: int = 0, deep_chunk_step: int = 64):
        self.pages = pages
        self.page_size = page_size
        self.states = states
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.prefill_block = prefill_block  # 0, or chunks end only at multiples of it (or the last token)
        # the position where a prefill token's attention work equals its weights' (the model's); 0: not counted
        self.attention_break_even = attention_break_even
        self.deep_chunk_step = deep_chunk_step  # no prefill block: a deep chunk reaches the next multiple
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ---- admission --------------------------------------------------------------------------------

    def check_fits(self, seq: Sequence) -> None:
        """Raise RequestTooLarge for a request that could never run, whatever else is running."""
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if seq.num_prompt_tokens >= self.max_model_len:
            raise RequestTooLarge(f"prompt has {seq.num_prompt_tokens} tokens; this model's context is "
                                  f"{self.max_model_len} tokens, and at least one must be left to generate")
        if total > self.max_model_len:
            raise RequestTooLarge(f"prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.params.max_tokens}) = "
                                  f"{total} tokens exceeds the context of {self.max_model_len} tokens")

    def add(self, seq: Sequence) -> None:
        """Queue seq; QueueFull when max_waiting requests already wait beyond the free running seats (requests
        added between two steps all wait until the next one, including those it will start at once)."""
        self.check_fits(seq)
        free_seats = max(0, self.max_num_seqs - len(self.running))
        if len(self.waiting) >= self.max_waiting + free_seats:
            raise QueueFull(f"{len(self.waiting) - free_seats} requests are already waiting for a running seat")
        self.waiting.append(seq)

    def add_next(self, seqs: list[Sequence]) -> None:
        """Queue seqs ahead of the other waiting requests (the other choices of a running request)."""
        self.waiting.extendleft(reversed(seqs))

    def abort(self, request_id: str) -> Sequence | None:
        for seq in [*self.waiting, *self.running]:
            if seq.request_id == request_id:
                self.drop(seq, aborted=True)
                seq.finish_reason = "abort"
                return seq
        return None

    def drop(self, seq: Sequence, aborted: bool = False) -> None:
        """Take seq out of the queue or the running batch and free everything it holds (its cache lock
        and captures, pages, slot), even when the cache's release raises (that error propagates).
        `aborted`: ended early by its client or a shutdown (not a failed step): the cache keeps what it
        snapshotted."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.status = Status.FINISHED
        try:
            self._release_cache(seq, finished=False, aborted=aborted)
        finally:
            self.release(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [], 0, [])
        budget = self.max_num_batched_tokens
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq.status != Status.RUNNING:
                continue  # preempted while making room for an earlier one
            if not self._make_room(seq, seq.num_computed + 1, batch):
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(1)
            budget -= 1
        batch.num_decode = len(batch.seqs)
        # streams wait for this step: a chunk's attention work counts too (_chunk_cost); 0: it does not
        break_even = self.attention_break_even if batch.num_decode else 0
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            n = self._chunk_len(seq, budget, break_even)
            if n:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= self._chunk_cost(seq, n, break_even)
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            try:
                admitted = self._admit(seq) or (self._stuck(seq) and self._admit_from_the_start(seq))
            except Exception as e:
                raise SequenceFailed(seq) from e
            if not admitted:
                break
            self.waiting.popleft()
            if seq.ready_logits is not None:
                batch.ready.append(seq)
                continue
            n = self._chunk_len(seq, budget, break_even)
            if not n:
                break  # admitted; its first block waits for a step with room
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= self._chunk_cost(seq, n, break_even)
        self._ask_captures(batch)
        return batch

    def _ask_captures(self, batch: ScheduledBatch) -> None:
        """The cache's captures for each prefill chunk of the batch (asked once the batch is complete)."""
        for seq, n in zip(batch.seqs[batch.num_decode:], batch.num_new_tokens[batch.num_decode:], strict=True):
            if n > 1:
                pool, wanted = self.cache.captures(seq.admission, seq.num_computed, seq.num_computed + n)
                if wanted:
                    batch.captures[seq.request_id] = wanted
                    batch.capture_pool = pool

    def _chunk_len(self, seq: Sequence, budget: int, break_even: int = 0) -> int:
        """Prefill tokens for seq this step; with a prefill block, cut down to the last block boundary.

            block = 64, num_computed = 128, budget = 150, num_tokens = 400
            128          192          256 | 278             400
            |--- block ---|--- block ---|-+--- (budget ends) ---|     -> 128 tokens, ending at 256

        `break_even` (not 0): the budget pays for the chunk's attention work too (_chunk_cost), but it always buys the
        tokens up to the next block boundary (of deep_chunk_step tokens without a prefill block) if it could
        buy them at position 0, so that a deep prompt still advances.
        """
        if break_even:
            step = self.prefill_block or self.deep_chunk_step
            budget = max(budget * break_even // (break_even + seq.num_computed),
                         min(budget, step - seq.num_computed % step))
        n = seq.next_chunk_len(budget)
        end = seq.num_computed + n
        if self.prefill_block and end < seq.num_tokens:
            end = end // self.prefill_block * self.prefill_block
        return max(0, end - seq.num_computed)

    @staticmethod
    def _chunk_cost(seq: Sequence, n: int, break_even: int) -> int:
        """What n prefill tokens of seq from its position take of the step's budget: n, or with a `break_even`
        n * (1 + position / break_even), the time they take relative to n tokens at position 0."""
        return n + n * seq.num_computed // break_even if break_even else n

    def _admit(self, seq: Sequence, resume: bool = True) -> bool:
        """Give `seq` a slot and pages for all its tokens, resuming from the cache where it can (`resume`)."""
        if self.states.num_free == 0:
            return False
        seq.state_slot = self.states.alloc()
        try:
            admission = self.cache.admit(CacheRequest(
                seq.token_ids, seq.state_slot, message_starts=seq.message_starts,
                user_message_starts=seq.user_message_starts, breakpoints=seq.breakpoints,
                cache_prompt=seq.params.cache_prompt and resume,
                cache_salt=seq.params.cache_salt))
            if admission is not None:
                self._apply(seq, admission)
            admitted = admission is not None and self._grow(seq, seq.num_tokens)
        except BaseException:
            self._unadmit(seq)
            raise
        if not admitted:
            self._unadmit(seq)
            return False
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _stuck(self, seq: Sequence) -> bool:
        """seq was not admitted, nothing runs, a slot is free, and the pool has fewer free pages than seq's
        tokens need from position 0: nothing will free any (cached pages go only when an admission evicts
        them, and a resume's own matched path holds some), so waiting would never end. (A cache waiting for
        a remote lookup, or every slot held, is waiting for something that will come.)"""
        return (not self.running and self.states.num_free > 0  # (an undone admission left seq no page)
                and self._pages_needed(seq, seq.num_tokens) > self.pages.num_free)

    def _admit_from_the_start(self, seq: Sequence) -> bool:
        """Admit a stuck seq from position 0 without the cache, which leaves every cached page free to evict
        (check_fits let the prompt in, so the pool holds it once they are); the report says why."""
        if not self._admit(seq, resume=False):
            return False  # pages some tier's move still pins: the next step tries again
        seq.admission.report.miss_reason = "pool_full"  # (seq's report, unless seq is a preempted one's recompute)
        log.info("%s: resuming its %d tokens did not fit the KV pool beside the cached pages it matched; "
                 "prefilled from the start, without the prefix cache", seq.request_id, seq.num_tokens)
        return True

    @staticmethod
    def _apply(seq: Sequence, admission: Admission) -> None:
        """What the cache resumed becomes seq's: its pages, computed count, logits and report (the snapshots
        it took before a preemption still count). A sequence preempted after its first token keeps its report:
        that says how its prompt was served (the usage's cached tokens, counted by the metrics at that token),
        and its recompute may resume past the prompt, from a snapshot it took of its own output."""
        seq.admission = admission
        seq.page_table = list(admission.page_table)
        seq.num_computed = seq.num_cached = admission.num_cached
        seq.ready_logits = admission.ready_logits
        if not seq.num_output_tokens:
            admission.report.snapshots_taken += seq.cache.snapshots_taken
            admission.report.breakpoint_stored = max(admission.report.breakpoint_stored, seq.cache.breakpoint_stored)
            seq.cache = admission.report

    def _unadmit(self, seq: Sequence) -> None:
        """Undo a partial admission: seq stays queued, holding nothing."""
        try:
            self._release_cache(seq, finished=False)
        finally:
            self.release(seq)
            seq.num_computed = seq.num_cached = 0
            seq.ready_logits = None

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(seq.page_table))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Ensure seq's page table covers num_tokens, evicting cached pages if the pool is short."""
        need = self._pages_needed(seq, num_tokens)
        if need > self.pages.num_free:
            self.cache.evict_pages(need - self.pages.num_free)
        if need > self.pages.num_free:
            return False
        seq.page_table.extend(self.pages.alloc(need))
        return True

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Grow seq to num_tokens, preempting the latest-admitted other sequences if needed."""
        while not self._grow(seq, num_tokens):
            victims = [s for s in reversed(self.running) if s is not seq and s not in batch.seqs]
            victim = victims[0] if victims else seq
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Release a running sequence and put it back at the front of the queue, to be recomputed."""
        self.running.remove(seq)
        try:
            self._release_cache(seq, finished=False)
        finally:
            self.release(seq)
            seq.status = Status.WAITING
            seq.num_computed = seq.num_cached = 0
            seq.ready_logits = None
            self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Return seq's pages and working slot (the cache holds its own references to shared pages)."""
        if seq.page_table:
            self.pages.decref(seq.page_table)
            seq.page_table = []
        if seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        try:
            self._release_cache(seq, finished=True)
        except Exception:  # the request is complete: failing to cache it must not fail it
            log.exception("caching the end of %s failed", seq.request_id)
        finally:
            self.release(seq)

    def _release_cache(self, seq: Sequence, finished: bool, aborted: bool = False) -> None:
        """Tell the cache seq stops running (its locks and captures go); seq's admission is over."""
        admission, seq.admission = seq.admission, None
        if admission is not None:
            seq.cache.snapshots_taken += self.cache.release(admission, self._view(seq), finished, aborted)

    @staticmethod
    def _view(seq: Sequence) -> CacheRequest:
        """seq as the cache reads it after admission (its lists shared, not copied)."""
        return CacheRequest(seq.token_ids, seq.state_slot, seq.page_table, seq.num_computed,
                            cache_salt=seq.params.cache_salt)

    # ---- after a step -----------------------------------------------------------------------------

    def after_step(self, batch: ScheduledBatch, logits: torch.Tensor | None, sampled: list[Sequence],
                   elapsed_s: float) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Apply a step the runner computed in elapsed_s: `logits[i]` are the next-token logits of
        `sampled[i]`. Advances each sequence's computed count and tells the cache (snapshots). Returns the
        rows to sample and their sequences: those computed, then those admitted with restored logits."""
        prefill_tokens = batch.num_tokens - batch.num_decode
        if prefill_tokens:
            self.cache.observe_prefill(prefill_tokens, elapsed_s)
        row_of = {seq.request_id: i for i, seq in enumerate(sampled)}
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
            i = row_of.get(seq.request_id)
            seq.cache.snapshots_taken += self.cache.after_step(seq.admission, self._view(seq),
                                                               None if i is None else logits[i])
        if not batch.ready:
            return logits, sampled
        restored = torch.stack([seq.ready_logits.float().cpu() for seq in batch.ready])
        for seq in batch.ready:
            seq.ready_logits = None
        return (restored if logits is None else torch.cat([logits, restored])), sampled + batch.ready

    def append(self, seq: Sequence, token: int) -> str | None:
        """Add a sampled token to seq; the reason it must stop there ("stop": a stop token, "length": its
        max_tokens or the context is reached), else None. The caller finishes it (`finish`)."""
        seq.token_ids.append(token)
        if token in seq.eos_token_ids:
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- the engine's view ------------------------------------------------------------------------

    def cache_stats(self) -> CacheStats | None:
        return self.cache.stats()

    def close(self) -> None:
        """Release the cache's files and locks (at shutdown, once nothing runs)."""
        self.cache.close()

    def check_integrity(self) -> None:
        """The cache's bookkeeping holds, and every page's refcount is the cache's references plus the
        running sequences' page tables."""
        self.cache.check_integrity()
        expected: dict[int, int] = dict(self.cache.page_refs())
        for seq in self.running:
            for page in seq.page_table:
                expected[page] = expected.get(page, 0) + 1
        self.pages.check_integrity(expected)
