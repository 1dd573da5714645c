"""HybridPrefixCache: the prefix cache of a hybrid model, behind the scheduler's PrefixCache interface.

It joins the radix tree (which paths have KV where, where snapshots sit), the placement rules (where
to take snapshots), the planner (where to resume) and the tiers (where the bytes live). Per request:

    admit       match the prompt; plan the resume point by estimated time to first token across
                tiers; lock the matched path; share the device KV pages of [0, p) and copy the rest
                (host or disk pages, and the page holding p when p is mid-page, so the request never
                writes a page the tree owns) into fresh pages; copy the snapshot into the working slot
                (the stored copy stays); put what came from a slower tier back on the device (the
                tree shares the fresh pages, the snapshot gets a device copy when there is room);
                then place this prompt's snapshots. All of it is returned in an `Admission` for the
                scheduler to apply: the cache never writes the request.
    captures    while a step is built: reserve device slots for the placed positions strictly inside
                the chunk; the linear layers write their state there during the step.
    after_step  publish those captures, and at a placed position that ends the chunk copy the working
                slot into the device tier (demoting older snapshots down the tiers when it is full);
                attach each to the tree.
    release     when the request finishes, snapshot its end, insert its path and, with a disk tier,
                write what is not yet on disk; unlock.

Nothing a request does writes another conversation's stored state (DESIGN invariant 2). A request with a cache
salt matches and inserts under its salt's root of the tree, whose paths every segment tier chains from the salt's
key (segment.salt_key_of): it resumes nothing another salt (or no salt) stored, in any tier (DESIGN invariant 8).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from cairn.cache.base import Admission, CacheReport, CacheRequest, PrefixCache, ProbeResult
from cairn.cache.policy.pins import pin
from cairn.cache.policy.placement import (
    PlacementInput,
    PlacementOptions,
    breakpoint_position,
    place,
    placed_breakpoints,
    request_end_allowed,
)
from cairn.cache.policy.planner import Candidate, Plan, plan
from cairn.cache.policy.retention import retention_key
from cairn.cache.policy.speeds import SpeedMeter
from cairn.cache.remote.finder import RemoteFinder
from cairn.cache.segments.index import DiskIndex
from cairn.cache.segments.segment import salt_key_of
from cairn.cache.stats import CacheStats, DiskStats
from cairn.cache.tiers.base import Unreadable
from cairn.cache.tiers.tier_set import TieredSnapshot, TierSet
from cairn.cache.tree.nodes import DISK, HOST, REMOTE, LockHandle, MatchResult, Node, SnapshotEntry, page_indices
from cairn.cache.tree.tiered import TieredRadixTree
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool

log = logging.getLogger(__name__)
MAX_PLANS = 16  # plans per admission; each failed one marks at least one disk segment bad


@dataclass
class _RequestState:
    """The cache's bookkeeping for one running request (Admission.state)."""

    lock: LockHandle | None = None  # the matched path it resumed from, locked until release
    taken: set[int] = field(default_factory=set)  # positions this request attached snapshots at
    captures: dict[int, TieredSnapshot] = field(default_factory=dict)  # position -> slot a step writes
    missed: set[int] = field(default_factory=set)  # positions whose capture found no room
    breakpoints: dict[int, int] = field(default_factory=dict)  # planned positions that stand for a client's
    #   breakpoint -> its TTL in seconds (the longest, when several stand at one position)
    report: CacheReport | None = None  # the request's report (its breakpoint_stored raised as they are stored)


class HybridPrefixCache(PrefixCache):
    def __init__(self, kv: KVPool, states: StatePool, tiers: TierSet, placement: PlacementOptions,
                 speeds: SpeedMeter | None = None):
        self.kv, self.states, self.tiers, self.placement = kv, states, tiers, placement
        self.page_size = kv.page_size
        self.tree = TieredRadixTree(kv.page_size, tiers.page_allocators(), self._on_released, retention_key)
        tiers.tree = self.tree
        self.speeds = speeds or SpeedMeter({tier.name: tier.bandwidth for tier in tiers.tiers})
        self.counters: Counter[str] = Counter()  # snapshots_taken, snapshots_restored, cached_tokens, ...
        self.taken_by_source: Counter[str] = Counter()
        self.restored_by_tier: Counter[str] = Counter()
        self.dropped_by_reason: Counter[str] = Counter()
        self.resume_failures: Counter[str] = Counter()  # planned resumes abandoned: "corrupt", "evicted", "unavailable"
        # put back on the device what a resume reads from a slower tier (TierSet.promote); the tests of faults
        # in a lower tier turn it off to keep a running request's path on that tier alone
        self.promote_resumed = True
        self.indexes: dict[str, DiskIndex] = {}  # segment tier name -> its index of the store's segments
        for tier in tiers.tiers:
            if tier.pages is None:
                self.indexes[tier.name] = self._index(tier)
        self.remote = RemoteFinder(tiers.tiers, self.indexes)  # the remote tiers' lookups by prompt

    def _index(self, tier) -> DiskIndex:
        """Hang a segment tier's stored segments on the tree (start-up)."""
        index = DiskIndex(self.tree, tier, self.tiers.device.snapshot_bytes,
                          lambda has_logits, key: TieredSnapshot(has_logits, {tier.name: key}))
        found = index.index()
        log.info("%s cache: indexed %d segments, %d snapshots", tier.name, len(tier.store), found)
        if tier.store.readonly:
            log.info("%s cache is read-only here: segments its writer adds are picked up by a rescan "
                     "when a prompt misses, at most every %g s", tier.name, index.rescan_interval_s)
        return index

    # ---- admission --------------------------------------------------------------------------------

    def admit(self, req: CacheRequest) -> Admission | None:
        self._forget_stale_disk_keys()
        if not req.cache_prompt:
            return Admission(report=CacheReport(miss_reason="opted_out"))
        match = self._match(req)
        if match is None:
            self.counters["admissions_awaiting_remote"] += 1
            return None  # a remote lookup is running off this thread: admit when its answer is in
        admission = Admission()
        report = admission.report
        state = admission.state = _RequestState(report=report)
        for _ in range(MAX_PLANS):  # a copy found unreadable is marked bad (never planned again): plan again
            chosen = self._plan(match, len(req.token_ids))
            if chosen.position == 0:
                break
            outcome = self._resume(req, match, chosen, admission)
            if outcome == "wait":
                return None
            if outcome == "ok":
                break
            report.miss_reason = outcome  # "corrupt", "evicted" (a segment's value gone) or "unavailable"
            self.resume_failures[outcome] += 1
            self._forget_stale_disk_keys()
            match = self.tree.match(req.token_ids, salt_key=salt_key_of(req.cache_salt))
        report.match_length = match.match_len
        if report.miss_reason is None:
            report.miss_reason = self._miss_reason(match, chosen)
        placement = PlacementInput(
            prompt_len=len(req.token_ids), resume_position=admission.num_cached, match_length=match.match_len,
            path_has_deeper_snapshot=self._has_snapshot_beyond(match), message_starts=tuple(req.message_starts),
            user_message_starts=tuple(req.user_message_starts), breakpoints=tuple(sorted(req.breakpoints)))
        admission.planned_captures = place(placement, self.placement)
        placed = placed_breakpoints(admission.planned_captures, placement, self.placement)
        for p, ttl in req.breakpoints.items():
            q = breakpoint_position(p, self.placement)
            if q in placed:
                state.breakpoints[q] = max(state.breakpoints.get(q, 0), ttl)
        self._refresh_pins(req, match)
        return admission

    def _refresh_pins(self, req: CacheRequest, match: MatchResult) -> None:
        """Extend the pins of the snapshots already at this request's breakpoints (policy/pins.py): a client that
        reads a marked prefix again keeps it for another TTL."""
        if not self.tiers.pin_share or self.placement.policy != "cairn" or not req.breakpoints:
            return
        ends = {node.end: node for node in match.path if node.end <= match.match_len and node.snapshot is not None}
        now = self.tiers.clock()
        for p, ttl in req.breakpoints.items():
            node = ends.get(breakpoint_position(p, self.placement))
            if node is not None:
                pin(node.snapshot, ttl, now)
                self.tiers.pins["refreshed"] += 1

    def _match(self, req: CacheRequest, wait: bool = True) -> MatchResult | None:
        """The tree's match, after a rescan of a read-only disk store (at most every rescan_interval_s, a probe's
        too: the router ranks replicas by what admission would find) and, when the prompt is not all cached,
        hanging what the remote tier's lookup of it found. The lookup runs off the engine thread (prefetch):
        None while it runs (`wait`; else the match without it), and one is started if none was."""
        key = salt_key_of(req.cache_salt)
        match = self.tree.match(req.token_ids, salt_key=key)
        if match.match_len == len(req.token_ids):
            return match
        hung = any([index.rescan() for index in self.indexes.values()])
        found = self.remote.hang(req.token_ids, req.message_starts, wait, key)
        if found is None:
            return None
        return self.tree.match(req.token_ids, salt_key=key) if hung or found else match

    def prefetch(self, token_ids: list[int], message_starts: list[int], cache_salt: str | None = None
                 ) -> Future | None:
        """Any thread: start the remote tier's lookup of this prompt, so that admission (or a probe) finds the
        answer ready instead of waiting for Redis; a Future done when it is in (None: no remote tier)."""
        return self.remote.prefetch(token_ids, message_starts, salt_key_of(cache_salt))

    def _plan(self, match: MatchResult, prompt_len: int) -> Plan:
        """The planner's choice among the usable snapshots on the matched path (a copy in a disk segment
        marked bad is not usable; KV only there ends the usable path)."""
        candidates, load = [], dict.fromkeys(self.tiers.names, 0)
        page_bytes = self.kv.bytes_per_page
        for node in match.path:
            kv_tiers = self._usable(node.kv, lambda ref: ref.key)
            if node.end > match.match_len or not kv_tiers:
                break
            if kv_tiers[0] is not self.tiers.device:
                load[kv_tiers[0].name] += page_bytes * len(page_indices(node.start, node.end, self.page_size))
            entry = node.snapshot
            if entry is None or (node.end == prompt_len and not entry.has_logits):
                continue
            handle: TieredSnapshot = entry.handle
            snap_tiers = self._usable(handle.copies, lambda key: key)
            if not snap_tiers:
                continue
            cost = dict(load)
            cost[snap_tiers[0].name] += entry.nbytes
            candidates.append(Candidate(node.end, snap_tiers[0].name, cost, entry.source))
        unusable = {match.match_len: match.miss_reason} if match.miss_reason else {}
        return plan(candidates, prompt_len, self.speeds.snapshot(), unusable)

    def _usable(self, copies: dict, segment_key) -> list:
        """The tiers holding a usable copy among `copies` (a node's kv or a snapshot's copies), fastest first:
        a copy in a disk segment marked bad is not usable (segment_key(copy) names its segment)."""
        return [t for t in self.tiers.holding(copies)
                if t.name not in self.indexes or self.indexes[t.name].usable(segment_key(copies[t.name]))]

    @staticmethod
    def _miss_reason(match: MatchResult, chosen: Plan) -> str | None:
        """Why the deepest point past the resume position was not used (None when there is none)."""
        deeper = sorted(p for p in chosen.reasons if p > chosen.position)
        if deeper:
            why = chosen.reasons[deeper[-1]]
            return "slower" if why.startswith("slower") else why
        return match.miss_reason if match.match_len > chosen.position else None

    def _resume(self, req: CacheRequest, match: MatchResult, chosen: Plan, admission: Admission) -> str:
        """Load KV [0, p) into fresh or shared pages and the snapshot at p into req's slot, and record them in
        `admission`. "ok", "wait" (no pages now), "corrupt" (a segment failed verification or could not be read:
        it is marked bad), "evicted" (a segment's value was gone from its store: it is forgotten) or "unavailable"
        (its store did not answer: the tree's reference is dropped, the segment is not marked bad).
        On any outcome but "ok", or an exception, nothing is held for req."""
        p = chosen.position
        started = time.perf_counter()
        lock = self.tree.lock(match)
        table, copies = self._page_plan(match, p)
        resume = next(n for n in match.path if n.end == p)
        with self._segments_held(copies, resume.snapshot.handle, chosen.snapshot_tier):
            try:
                if not self._alloc_copies(table, copies):
                    self.tree.unlock(lock)
                    return "wait"
            except BaseException:
                self.tree.unlock(lock)
                raise
            try:
                logits = self._load(req, table, copies, resume.snapshot.handle, chosen.snapshot_tier)
            except BaseException:
                self._abandon(table, lock)
                raise
        if isinstance(logits, str):
            return self._abandon(table, lock, logits)
        admission.state.lock = lock
        admission.page_table, admission.num_cached = table, p
        if p == len(req.token_ids):
            admission.ready_logits = logits
        self._report_resume(admission.report, p, chosen, resume.snapshot.source, time.perf_counter() - started)
        if self.promote_resumed:  # after the load is timed: the planner prices loads by that time
            self.tiers.promote([n for n in match.path if n.end <= p], table, resume.snapshot.handle,
                               chosen.snapshot_tier, self.states, req.state_slot, logits)
        return "ok"

    @contextmanager
    def _segments_held(self, copies: list, handle: TieredSnapshot, snapshot_tier: str) -> Iterator[None]:
        """Pin, in their stores, the segments a resume will read (its pages' and its snapshot's) while it makes
        room and loads. The tree's lock keeps the path on the tree, not its segments in their stores: making
        room on the device demotes KV into a segment store, whose budget eviction took the least recently used
        segments, which could be the ones about to be read (then found missing, the resume fell back)."""
        wanted = {}  # (store, key) -> None: each segment once, in reading order
        for _, (node, _) in copies:
            tier = self.tiers.page_source(node) if node.pages is None else None
            if tier is not None and tier.name in self.indexes:
                wanted[tier.store, node.kv[tier.name].key] = None
        if snapshot_tier in self.indexes:
            wanted[self.tiers.by_name[snapshot_tier].store, handle.copies[snapshot_tier]] = None
        held = [(store, key) for store, key in wanted if store.pin(key)]  # one not indexed is not read either
        try:
            yield
        finally:
            for store, key in held:
                store.unpin(key)

    def _load(self, req: CacheRequest, table: list[int], copies: list, handle: TieredSnapshot, tier: str):
        """Copy the pages listed in `copies` and the snapshot into req's pages and slot; returns the
        snapshot's logits (or None), or why a segment could not be read (after `_unreadable` dealt with it)."""
        segments: dict = {}
        for index, (node, i) in copies:
            if node.pages is not None:
                self.kv.copy_page(node.pages[i], table[index])
                continue
            holder, page = self.tiers.page_copy(node, i, segments)
            if isinstance(page, str):
                return self._unreadable(holder.name, node.kv[holder.name].key, page)
            self.kv.k[:, table[index]], self.kv.v[:, table[index]] = page
        logits = self.tiers.restore_snapshot(handle, tier, self.states, req.state_slot)
        return self._unreadable(tier, handle.copies[tier], logits) if isinstance(logits, str) else logits

    def _unreadable(self, tier: str, key: bytes, why: Unreadable) -> Unreadable:
        """A segment of `tier` could not be read, for `why`: mark it bad ("corrupt"), or forget the tree's
        reference to it when its value was gone ("evicted") or its store did not answer ("unavailable": not
        remembered as bad, so a lookup hangs it again once the store answers); returns why."""
        if why == "corrupt":
            self.indexes[tier].mark_bad(key)
        else:
            self.indexes[tier].mark_gone(key)
        return why

    def _page_plan(self, match: MatchResult, p: int) -> tuple[list[int | None], list[tuple[int, tuple[Node, int]]]]:
        """The request's page table for [0, p): shared device pages, and None where a copy is needed."""
        sources = self.tree.prefix_page_sources(match, p)
        table: list[int | None] = []
        copies = []
        for index, (node, i) in enumerate(sources):
            partial = index == len(sources) - 1 and p % self.page_size != 0
            if node.pages is not None and not partial:
                table.append(node.pages[i])
            else:
                table.append(None)
                copies.append((index, (node, i)))
        return table, copies

    def _alloc_copies(self, table: list[int | None], copies: list) -> bool:
        allocator = self.kv.allocator
        if len(copies) > allocator.num_free:
            self.tiers.free_device_pages(len(copies) - allocator.num_free)
        if len(copies) > allocator.num_free:
            return False
        shared = [page for page in table if page is not None]
        allocator.incref(shared)
        for (index, _), page in zip(copies, allocator.alloc(len(copies)), strict=True):
            table[index] = page
        return True

    def _abandon(self, table: list[int], lock: LockHandle, why: str = "corrupt") -> str:
        self.kv.allocator.decref(table)
        self.tree.unlock(lock)
        return why

    def _report_resume(self, report: CacheReport, p: int, chosen: Plan, source: str, seconds: float) -> None:
        report.cached_tokens = report.resume_position = p
        report.resume_tier, report.resume_source = chosen.snapshot_tier, source
        self.counters["snapshots_restored"] += 1
        self.counters["cached_tokens"] += p
        self.restored_by_tier[chosen.snapshot_tier] += 1
        moved = sum(chosen.candidate.load_bytes.values())
        if moved and chosen.snapshot_tier != self.tiers.device.name:
            self.speeds.observe_load(chosen.snapshot_tier, moved, seconds)

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

    def captures(self, adm: Admission, start: int, end: int) -> tuple[StatePool | None, list[tuple[int, int]]]:
        state: _RequestState | None = adm.state
        if state is None:
            return None, []
        wanted = []
        for pos in sorted(p for p in adm.planned_captures if start < p < end and p not in state.captures):
            handle = self.tiers.reserve_snapshot()
            if handle is None:
                state.missed.add(pos)
                continue
            state.captures[pos] = handle
            wanted.append((pos, handle.copies[self.tiers.device.name].slot))
        return (self.tiers.device.pool if wanted else None), wanted

    def after_step(self, adm: Admission, req: CacheRequest, logits: torch.Tensor | None) -> int:
        state: _RequestState | None = adm.state
        if state is None:
            return 0
        num_taken = len(state.taken)
        for pos in sorted(p for p in state.captures if p < req.num_computed):
            self._attach(req, state, pos, adm.planned_captures.pop(pos), state.captures.pop(pos))
        for pos in sorted(p for p in state.missed if p < req.num_computed):
            state.missed.discard(pos)
            adm.planned_captures.pop(pos, None)
            self._budget_miss(req, pos)
        source = adm.planned_captures.pop(req.num_computed, None)
        if source is not None:
            self._take(req, state, source, logits if source == "prompt_end" else None)
        return len(state.taken) - num_taken

    def _take(self, req: CacheRequest, state: _RequestState, source: str, logits: torch.Tensor | None) -> None:
        """Copy req's working slot into the device tier and attach it at req.num_computed."""
        pos = req.num_computed
        if pos in state.taken or pos == 0:
            return
        handle = self.tiers.store_snapshot(self.states, req.state_slot, logits)
        if handle is None:
            self._budget_miss(req, pos)
            return
        self._attach(req, state, pos, source, handle)

    def _budget_miss(self, req: CacheRequest, pos: int) -> None:
        self.counters["snapshots_skipped_budget"] += 1
        self.tree.mark_budget_miss(req.token_ids[:pos], req.page_table, salt_key_of(req.cache_salt))

    def _attach(self, req: CacheRequest, state: _RequestState, pos: int, source: str, handle: TieredSnapshot) -> None:
        """Hang a device copy of req's state at `pos` on the tree (or free it if one is already there)."""
        nbytes = handle.copies[self.tiers.device.name].nbytes
        entry = SnapshotEntry(nbytes=nbytes, source=source, has_logits=handle.has_logits, handle=handle)
        if not self.tree.attach_snapshot(req.token_ids[:pos], req.page_table, entry, salt_key_of(req.cache_salt)):
            self.tiers.release(handle)
            return
        state.taken.add(pos)
        ttl = state.breakpoints.get(pos)
        if ttl is not None:
            if state.report is not None:
                state.report.breakpoint_stored = max(state.report.breakpoint_stored, pos)
            if self.tiers.pin_share:
                pin(entry, ttl, self.tiers.clock())
                self.tiers.pins["pinned"] += 1
        self.counters["snapshots_taken"] += 1
        self.taken_by_source[source] += 1

    def _on_released(self, entry: SnapshotEntry, reason: str) -> None:
        """The tree let go of a snapshot: free its device and host copies."""
        self.tiers.release(entry.handle)
        self.dropped_by_reason[reason] += 1

    # ---- release and eviction ---------------------------------------------------------------------

    def release(self, adm: Admission, req: CacheRequest, finished: bool, aborted: bool = False) -> int:
        """Snapshot the end of a finished request and write what it snapshotted through to disk, an aborted
        request's too (its snapshots were taken by steps that completed: a client that cancels, or a restart,
        must not lose them); whatever fails on the way, the request's captures and lock are let go (and
        adm.state cleared)."""
        state: _RequestState | None = adm.state
        if state is None:
            return 0
        num_taken = len(state.taken)
        try:
            for handle in state.captures.values():  # reserved for a step that never completed
                self.tiers.release(handle)
            state.captures.clear()
            if finished and req.num_computed > 0 and request_end_allowed(req.num_computed, self.placement):
                self._take(req, state, "request_end", None)
            if (finished or aborted) and state.taken and any(t.write_through for t in self.tiers.tiers):
                tokens = req.token_ids[: max(state.taken)]
                node = self.tree.insert(tokens, req.page_table, salt_key_of(req.cache_salt))
                self.tiers.write_through(node, self.tiers.request_source(self.kv, req.page_table))
        finally:
            adm.state = None
            if state.lock is not None:
                self.tree.unlock(state.lock)
            self._forget_stale_disk_keys()
        return len(state.taken) - num_taken

    def evict_pages(self, num_pages: int) -> int:
        freed = self.tiers.free_device_pages(num_pages)
        self.counters["kv_pages_evicted"] += freed
        return freed

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.speeds.observe_prefill(num_tokens, seconds)

    def close(self) -> None:
        self.remote.close()
        for name in self.indexes:
            self.tiers.by_name[name].store.close()

    # ---- disk -------------------------------------------------------------------------------------

    def _forget_stale_disk_keys(self) -> None:
        """Drop the tree's references to disk segments the store evicted or that were found bad; hang again what
        lies below one found bad and since written again."""
        for index in self.indexes.values():
            index.forget()
            index.relink()

    # ---- reporting --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        align = self.placement.align
        for position, entry, _ in self.tree.iter_snapshots():
            if not entry.handle.copies:
                raise AssertionError(f"the snapshot at {position} has no copy on any tier")
            if align and position % align:  # placement aligns them; stored ones share the block (the digest)
                raise AssertionError(f"the snapshot at {position} is off the prefill blocks of {align}")
        self.tiers.check_integrity()
        for name in self.indexes:  # each segment store's own bookkeeping (disk, Redis)
            self.tiers.by_name[name].store.check_integrity()

    def page_refs(self) -> dict[int, int]:
        return self.tree.page_refs()

    def stats(self) -> CacheStats:
        per_tier = Counter()
        for _, entry, _ in self.tree.iter_snapshots():
            per_tier.update(list(entry.handle.copies))
        pools = self.tiers.page_tiers
        host = self.tiers.by_name.get(HOST)
        disk, remote = (self._segment_stats(name) for name in (DISK, REMOTE))
        return CacheStats(
            counters=dict(self.counters), taken_by_source=dict(self.taken_by_source),
            restored_by_tier=dict(self.restored_by_tier), dropped_by_reason=dict(self.dropped_by_reason),
            resume_failures=dict(self.resume_failures),
            tier_moves=dict(self.tiers.moved), tier_drops=dict(self.tiers.dropped),
            pinned_bytes=self.tiers.pinned_bytes(), pins=dict(self.tiers.pins),
            snapshots_per_tier={t: per_tier.get(t, 0) for t in self.tiers.names},
            snapshot_used_bytes={t.name: t.used_bytes for t in pools},
            snapshot_budget_bytes={t.name: t.budget_bytes for t in pools},
            num_tree_nodes=self.tree.num_nodes,
            host_kv_used_bytes=host.kv.used_bytes if host is not None else None,
            disk=disk, remote=remote)

    def _segment_stats(self, name: str) -> DiskStats | None:
        index = self.indexes.get(name)
        if index is None:
            return None
        tier = self.tiers.by_name[name]
        return DiskStats(tier.store.used_bytes, len(tier.store), dict(tier.store.faults), dict(index.forgotten),
                         tier.operations(), tier.store.segment_counts() if name == DISK else {},
                         tier.store.effective_budget_bytes)

    # ---- probing (the router's question) ------------------------------------------------------------

    def probe(self, token_ids: list[int], cache_salt: str | None = None) -> ProbeResult:
        """What admitting this prompt now would plan. Locks, copies and loads nothing, and never waits for
        Redis: what the remote tier's lookup of the prompt found (started by prefetch, or here, for a later
        probe) is hung on the tree as admission would, and counted in the plan, as is what a read-only disk
        store's rescan finds. Call it on the engine thread
        (between steps), like every other method here."""
        self._forget_stale_disk_keys()
        req = CacheRequest(token_ids, state_slot=-1, cache_salt=cache_salt)
        chosen = self._plan(self._match(req, wait=False), len(token_ids))
        return ProbeResult(chosen.position, chosen.estimated_s, chosen.snapshot_tier,
                           self.remote.deepest_snapshot(token_ids, salt_key_of(cache_salt)))
