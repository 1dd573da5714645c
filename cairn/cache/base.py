"""PrefixCache: the interface between the scheduler and the prefix cache.

The scheduler calls these at fixed points of a request's life; a cache that caches nothing is the
separate `NullCache`, not a flag inside a real one.

    admit(seq)        before a request first runs; may resume it (sets num_cached / num_computed,
                      shares KV pages into seq.page_table, restores state into seq.state_slot) and
                      may set seq.cuts, positions where its prefill chunks must end. When the whole
                      prompt is resumed from a snapshot that stored its logits, it sets seq.ready_logits
                      and the request computes nothing before its first token.
    captures(seq, start, end)  while a step is built: the positions inside the prefill segment where
                      the state is to be saved (snapshots taken mid-chunk), with reserved slots.
    after_step(seq, logits)  after every step that computed tokens for seq; publishes the captures and
                      takes the snapshot due at seq.num_computed (`logits`: the next-token logits
                      there, when this step made them).
    release(seq, finished)  when seq stops running (finished, aborted or preempted); a finished
                      request's path is inserted before its pages and slot are released.
    evict_pages(n)    free at least n KV pages if it can; returns how many it freed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from cairn.cache.stats import CacheStats
from cairn.memory.state_pool import StatePool
from cairn.sequence import Sequence


class PrefixCache(ABC):
    @abstractmethod
    def admit(self, seq: Sequence) -> bool:
        """Plan and apply seq's resume point. False: not admissible now (retry on a later step)."""

    @abstractmethod
    def after_step(self, seq: Sequence, logits: torch.Tensor | None) -> None:
        """Seq's working slot now holds its state at seq.num_computed; `logits` are those at num_computed - 1
        when this step computed them (prefill end or decode), else None."""

    def captures(self, seq: Sequence, start: int, end: int) -> tuple[StatePool | None, list[tuple[int, int]]]:
        """Where this step, computing seq's positions [start, end), should save its recurrent state strictly
        inside the segment: (the pool, [(position, slot)]). The slots are reserved until after_step."""
        return None, []

    @abstractmethod
    def release(self, seq: Sequence, finished: bool) -> None:
        """Seq leaves the running set; drop its locks (and insert its path when finished)."""

    @abstractmethod
    def evict_pages(self, num_pages: int) -> int:
        """Free at least num_pages unlocked KV pages if possible; returns the number freed."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release files and locks (the disk tier's); the cache is not used afterwards."""

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:  # noqa: B027 (optional hook)
        """A step computed num_tokens prefill tokens in `seconds` (the planner's prefill speed)."""

    def check_integrity(self) -> None:  # noqa: B027 (optional hook: a cache with no bookkeeping has nothing to check)
        """Raise AssertionError if the cache's bookkeeping is inconsistent."""

    def stats(self) -> CacheStats | None:
        """Counters and gauges (cache/stats.py); None: nothing to report."""
        return None

    def page_refs(self) -> dict[int, int]:
        """Page id -> references the cache holds (for the engine's integrity check)."""
        return {}


class NullCache(PrefixCache):
    """Caches nothing: every request is prefilled from position 0."""

    def admit(self, seq: Sequence) -> bool:
        return True

    def after_step(self, seq: Sequence, logits: torch.Tensor | None) -> None:
        pass

    def release(self, seq: Sequence, finished: bool) -> None:
        pass

    def evict_pages(self, num_pages: int) -> int:
        return 0
