"""HybridPrefixCache: the prefix cache of a hybrid model, behind the scheduler's PrefixCache interface.

It joins the radix tree (which paths have KV, where snapshots sit), the placement rules (where to take
snapshots) and a snapshot tier (where their bytes live). For each request:

    admit       match the prompt; resume at the deepest usable snapshot p: share the tree's KV pages
                for [0, p) (copying the page that holds p when p is mid-page, so the request never
                writes a page the tree owns), copy the snapshot into the working slot (the stored
                one stays), lock the matched path; then place this prompt's snapshots as chunk cuts.
    after_step  at a placed position, copy the working slot into the tier and attach it to the tree
                with the path's KV pages (evicting by retention when the tier is full).
    release     when the request finishes, snapshot its end and insert its whole path; unlock.

Nothing a request does writes another conversation's stored state: tree pages below the resume point
are only read, and snapshots are copied in and out, never moved (DESIGN invariant 2).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from cairn.cache.base import PrefixCache
from cairn.cache.placement import PlacementInput, PlacementOptions, place, request_end_allowed
from cairn.cache.radix import RadixTree
from cairn.cache.radix_types import LockHandle, MatchResult, Node, SnapshotEntry
from cairn.cache.tiers import SnapshotTier
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """The cache's bookkeeping for one running request (seq.cache_state)."""

    places: dict[int, str]  # position -> placement source of the snapshots still to take
    lock: LockHandle | None = None  # the matched path it resumed from, locked until release
    taken: set[int] = field(default_factory=set)  # positions this request attached snapshots at


class HybridPrefixCache(PrefixCache):
    def __init__(self, kv: KVPool, states: StatePool, tier: SnapshotTier, placement: PlacementOptions):
        self.kv = kv
        self.states = states
        self.tier = tier
        self.placement = placement
        self.page_size = kv.page_size
        self.tree = RadixTree(kv.page_size, kv.allocator, self._on_released)
        self.counters: Counter[str] = Counter()  # plain counters (snapshots_taken, cached_tokens, ...)
        self.taken_by_source: Counter[str] = Counter()  # snapshots taken, by placement source
        self.dropped_by_reason: Counter[str] = Counter()  # snapshots released by the tree, by reason

    # ---- admission --------------------------------------------------------------------------------

    def admit(self, seq: Sequence) -> bool:
        if not seq.params.cache_prompt:
            seq.cuts, seq.cache_state = [], None
            seq.cache.miss_reason = "opted_out"
            return True
        match = self.tree.match(seq.token_ids)
        state = _RequestState(places={})
        if match.resume_position > 0 and not self._resume(seq, match, state):
            return False
        seq.cache.match_length = match.match_len
        seq.cache.miss_reason = match.miss_reason
        state.places = place(PlacementInput(
            prompt_len=seq.num_tokens, resume_position=seq.num_computed, match_length=match.match_len,
            path_has_deeper_snapshot=self._has_snapshot_beyond(match), message_starts=tuple(seq.message_starts),
            user_message_starts=tuple(seq.user_message_starts)), self.placement)
        seq.cuts = sorted(state.places)
        seq.cache_state = state
        return True

    def _resume(self, seq: Sequence, match: MatchResult, state: _RequestState) -> bool:
        """Share [0, p) and restore the snapshot at p into seq's working slot. False: no page for the copy."""
        p = match.resume_position
        state.lock = self.tree.lock(match)
        table = self.tree.prefix_pages(match, p)
        shared = table[: p // self.page_size]
        if p % self.page_size:
            if self.kv.allocator.num_free == 0:
                self.tree.evict_pages(1)
            if self.kv.allocator.num_free == 0:
                self.tree.unlock(state.lock)
                return False
            copy = self.kv.allocator.alloc(1)[0]
            self.kv.copy_page(table[-1], copy)
        else:
            copy = None
        self.kv.allocator.incref(shared)
        seq.page_table = shared + ([copy] if copy is not None else [])
        entry = match.resume_node.snapshot
        logits = self.tier.restore(entry.handle, self.states, seq.state_slot)
        seq.num_computed = seq.num_cached = p
        if p == seq.num_tokens:
            seq.ready_logits = logits
        seq.cache.cached_tokens, seq.cache.resume_position = p, p
        seq.cache.resume_tier, seq.cache.resume_source = self.tier.name, entry.source
        self.counters["snapshots_restored"] += 1
        self.counters["cached_tokens"] += p
        return True

    def _has_snapshot_beyond(self, match: MatchResult) -> bool:
        """The cached path the prompt leaves holds a snapshot deeper than the divergence point."""
        if not match.path:
            return False
        stack: list[Node] = [match.path[-1]]
        while stack:
            node = stack.pop()
            if node.snapshot is not None and node.end > match.match_len:
                return True
            stack.extend(node.children.values())
        return False

    # ---- snapshots --------------------------------------------------------------------------------

    def after_step(self, seq: Sequence, logits: torch.Tensor | None) -> None:
        state: _RequestState | None = seq.cache_state
        if state is None:
            return
        source = state.places.pop(seq.num_computed, None)
        if source is not None:
            self._take(seq, state, source, logits if source == "prompt_end" else None)

    def _take(self, seq: Sequence, state: _RequestState, source: str, logits: torch.Tensor | None) -> None:
        """Copy seq's working slot into the tier and attach it at seq.num_computed."""
        pos = seq.num_computed
        if pos in state.taken or pos == 0:
            return
        stored = self.tier.store(self.states, seq.state_slot, logits)
        while stored is None and self.tree.evict_snapshots(1):
            stored = self.tier.store(self.states, seq.state_slot, logits)
        if stored is None:
            self.counters["snapshots_skipped_budget"] += 1
            return
        entry = SnapshotEntry(nbytes=stored.nbytes, source=source, has_logits=logits is not None, handle=stored)
        if not self.tree.attach_snapshot(seq.token_ids[:pos], seq.page_table, entry):
            self.tier.free(stored)
            return
        state.taken.add(pos)
        seq.cache.snapshots_taken += 1
        self.counters["snapshots_taken"] += 1
        self.taken_by_source[source] += 1

    def _on_released(self, entry: SnapshotEntry, reason: str) -> None:
        """The tree let go of a snapshot: free its bytes (the device tier is the last tier here)."""
        self.tier.free(entry.handle)
        self.dropped_by_reason[reason] += 1

    # ---- release and eviction ---------------------------------------------------------------------

    def release(self, seq: Sequence, finished: bool) -> None:
        state: _RequestState | None = seq.cache_state
        if state is None:
            return
        if finished and seq.num_computed > 0 and request_end_allowed(seq.num_computed, self.placement):
            self._take(seq, state, "request_end", None)
        if state.lock is not None:
            self.tree.unlock(state.lock)
        seq.cache_state = None

    def evict_pages(self, num_pages: int) -> int:
        freed = self.tree.evict_pages(num_pages)
        self.counters["kv_pages_evicted"] += freed
        return freed

    # ---- reporting --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        if self.tree.snapshot_bytes != self.tier.used_bytes:
            raise AssertionError(f"tree holds {self.tree.snapshot_bytes} snapshot bytes, tier {self.tier.used_bytes}")
        if self.tier.used_bytes > self.tier.budget_bytes:
            raise AssertionError("the device snapshot tier is over its budget")

    def page_refs(self) -> dict[int, int]:
        return self.tree.page_refs()

    def stats(self) -> dict:
        """Counters and gauges in the server's metrics convention: keys starting with num_ or ending in
        _bytes are gauges, others counters; a dict value is one series per label value."""
        return {
            **self.counters,
            "snapshots_taken_by{source}": dict(self.taken_by_source),
            "snapshots_dropped{reason}": dict(self.dropped_by_reason),
            "num_snapshots{tier}": {self.tier.name: self.tree.num_snapshots},
            "snapshot_used_bytes{tier}": {self.tier.name: self.tier.used_bytes},
            "snapshot_budget_bytes{tier}": {self.tier.name: self.tier.budget_bytes},
            "num_tree_nodes": self.tree.num_nodes,
        }
