"""PrefixCache: the interface between the scheduler and the prefix cache.

Only the scheduler calls the cache at the fixed points of a request's life; outside them, the engine asks it
prefetch, probe, stats and page_refs for the server (Engine.prefetch / probe / cache_stats /
num_cached_pages). The cache reads the request through a `CacheRequest` the scheduler builds, and
answers with values; it never writes the scheduler's request (the scheduler applies what the cache
returns). A cache that caches nothing is the separate `NullCache`, not a flag inside a real one.

    admit(req)        before a request first runs: an `Admission` (where it resumes: KV pages of the
                      resumed prefix with a reference held for the request, its recurrent state already
                      restored into req.state_slot, the next-token logits when the whole prompt was
                      resumed from a snapshot that stored them, the cache's report), or None when it
                      cannot be admitted now (it then holds nothing: retry on a later step).
    captures(adm, start, end)  while the scheduler builds a step: the positions strictly inside the
                      prefill segment [start, end) where the step saves the state, with reserved slots.
    after_step(adm, req, logits)  after every step that computed tokens for req; publishes the captures
                      and takes the snapshot due at req.num_computed; returns how many it attached.
    release(adm, req, finished, aborted)  when req stops running (finished, aborted or preempted); a finished
                      or aborted request's path is inserted before the scheduler frees its pages and slot.
    evict_pages(n)    free at least n KV pages if it can; returns how many it freed.
    prefetch(ids, starts, salt)  from any thread, before the request is queued: start the lookups admission would
                      otherwise wait for (the remote tier's); admit returns None while one is running.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cairn.cache.stats import CacheStats
from cairn.memory.state_pool import StatePool


@dataclass
class CacheReport:
    """What the prefix cache did for a request (reported per request and per prefill log line)."""

    cached_tokens: int = 0  # prompt tokens not computed because they were resumed from the cache
    resume_position: int = 0  # position the request resumed at (0: cold)
    resume_tier: str | None = None  # tier the resumed snapshot came from
    resume_source: str | None = None  # placement rule that created that snapshot (grid, message, ...)
    match_length: int = 0  # longest common prefix with any cached path
    miss_reason: str | None = None  # why a deeper point than resume_position was not usable
    snapshots_taken: int = 0  # snapshots this request added to the cache
    breakpoint_stored: int = 0  # deepest position where this request added a snapshot placed for one of its cache
    #   breakpoints (0: none); the prompt tokens below it and above cached_tokens are the ones it stored for the client


@dataclass(frozen=True)
class CacheRequest:
    """A request as the cache reads it. The lists are the scheduler's own (no copy is made): the cache
    reads them during the call and never modifies or keeps them."""

    token_ids: list[int]  # the prompt followed by the tokens generated so far
    state_slot: int  # the request's working recurrent-state slot
    page_table: list[int] = field(default_factory=list)  # KV page of each page_size tokens (empty in admit)
    num_computed: int = 0  # tokens whose KV is in page_table and whose state the working slot holds
    message_starts: list[int] = field(default_factory=list)  # token position of each chat message start
    user_message_starts: list[int] = field(default_factory=list)  # the subset starting a user message
    breakpoints: dict[int, int] = field(default_factory=dict)  # the client's cache breakpoints: position -> TTL (s)
    cache_prompt: bool = True  # False: the client opted out of the prefix cache
    cache_salt: str | None = None  # the tenant's namespace: nothing is shared with another salt's (None: unsalted)


@dataclass
class Admission:
    """The cache's answer to admit, for the scheduler to apply, and the cache's own bookkeeping for the
    request (pass the same record back on every later call for it).

        0                 num_cached                                  num_tokens
        |-- page_table ---|-- pages the scheduler adds, tokens it computes --|
    """

    num_cached: int = 0  # tokens resumed: KV in page_table, recurrent state restored into req.state_slot
    page_table: list[int] = field(default_factory=list)  # pages of [0, num_cached), one reference held for the request
    ready_logits: torch.Tensor | None = None  # next-token logits when num_cached is the whole prompt (none computed)
    report: CacheReport = field(default_factory=CacheReport)  # what the cache did (snapshots_taken: 0 here; the
    #   cache raises breakpoint_stored as the request's steps store its breakpoints' snapshots)
    # the planned captures: position -> placement source of each snapshot still to take for the request (the
    # cache plans them at admission and pops each one as its step takes it or finds no room for it)
    planned_captures: dict[int, str] = field(default_factory=dict)
    state: object | None = None  # the cache's private bookkeeping (lock on the matched path, captures in flight)


@dataclass(frozen=True)
class ProbeResult:
    """The cache's answer to a probe (the router's question: where would this prompt resume here?)."""

    position: int = 0  # resume position the planner would choose now (0: cold prefill)
    estimated_s: float | None = None  # the planner's estimated seconds to the first token (None: unknown)
    tier: str | None = None  # tier the chosen snapshot comes from (None: cold)
    remote_position: int = 0  # deepest snapshot the remote tier holds for the prompt (0: none, or not asked)


class PrefixCache(ABC):
    @abstractmethod
    def admit(self, req: CacheRequest) -> Admission | None:
        """Plan req's resume point and load it (KV pages, state into req.state_slot). None: not admissible
        now (retry on a later step); nothing is then held for req."""

    @abstractmethod
    def after_step(self, adm: Admission, req: CacheRequest, logits: torch.Tensor | None) -> int:
        """req's working slot now holds its state at req.num_computed; `logits` are those at num_computed - 1
        when this step computed them (prefill end or decode), else None. Returns the snapshots attached."""

    def captures(self, adm: Admission, start: int, end: int) -> tuple[StatePool | None, list[tuple[int, int]]]:
        """Where the step computing the request's positions [start, end) should save its recurrent state
        strictly inside the segment: (the pool, [(position, slot)]). The slots are reserved until after_step."""
        return None, []

    @abstractmethod
    def release(self, adm: Admission, req: CacheRequest, finished: bool, aborted: bool = False) -> int:
        """req leaves the running set; drop its locks (and insert its path when finished, or `aborted`: a client
        or a shutdown ended it early, and what its completed steps snapshotted is kept as a finished request's
        is). Returns the snapshots attached on the way (the end of a finished request)."""

    @abstractmethod
    def evict_pages(self, num_pages: int) -> int:
        """Free at least num_pages unlocked KV pages if possible; returns the number freed."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release files and locks (the disk tier's); the cache is not used afterwards."""

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:  # noqa: B027 (optional hook)
        """A step computed num_tokens prefill tokens in `seconds` (the planner's prefill speed)."""

    def check_integrity(self) -> None:  # noqa: B027 (optional hook: a cache with no bookkeeping has nothing to check)
        """Raise AssertionError if the cache's bookkeeping is inconsistent."""

    def probe(self, token_ids: list[int], cache_salt: str | None = None) -> ProbeResult:
        """What admitting this prompt (under cache_salt) now would plan (ProbeResult); locks, copies and loads
        nothing. A cache that caches nothing resumes nowhere."""
        return ProbeResult()

    def prefetch(self, token_ids: list[int], message_starts: list[int], cache_salt: str | None = None
                 ) -> Future | None:
        """Any thread: start looking this prompt up in a tier that is slow to ask (the remote tier), so that
        admission finds the answer ready; a Future done when it is in, or None (nothing to look up)."""
        return None

    def stats(self) -> CacheStats | None:
        """Counters and gauges (cache/stats.py); None: nothing to report."""
        return None

    def page_refs(self) -> dict[int, int]:
        """Page id -> references the cache holds (for the scheduler's integrity check)."""
        return {}


class NullCache(PrefixCache):
    """Caches nothing: every request is prefilled from position 0."""

    def admit(self, req: CacheRequest) -> Admission:
        return Admission()

    def after_step(self, adm: Admission, req: CacheRequest, logits: torch.Tensor | None) -> int:
        return 0

    def release(self, adm: Admission, req: CacheRequest, finished: bool, aborted: bool = False) -> int:
        return 0

    def evict_pages(self, num_pages: int) -> int:
        return 0
