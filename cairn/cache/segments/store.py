"""SegmentStore: the store of segments a SegmentTier writes and reads (tier.py), and SegmentInfo, what a store
knows of a segment without reading it.

Two stores implement it: DiskStore (cairn/cache/disk/store.py: files in a namespace directory, one writer per
namespace) and RedisSegmentStore (cairn/cache/remote/store.py: values in a Redis shared by replicas, written
behind the requests). A new kind of store is a third implementation, in a folder of its own, built in
cairn/cache/factory.py; the tier, the index and the format are this package's and do not change.

What this is not: a store, the segment format (segment.py), or the choice of what to write when (the tier's
and the cache's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cairn.cache.segments.segment import Segment
    from cairn.cache.tiers.base import Unreadable


@dataclass(frozen=True)
class SegmentInfo:
    """What the index knows about a stored segment, without reading its file."""

    key: bytes  # 32-byte segment key
    parent_key: bytes | None  # None for a child of the root
    start_position: int  # absolute position of the first token
    num_tokens: int  # tokens in the segment
    has_snapshot: bool  # holds a recurrent-state snapshot at start_position + num_tokens
    has_logits: bool  # holds the logits at start_position + num_tokens - 1
    size_bytes: int  # file size, counted against the budget
    last_used: float  # wall-clock seconds of the last get/put in this process (file mtime at scan)


class SegmentStore(Protocol):
    """Segments by key, verified on every read, within the store's own budget (it evicts by itself).

    Calls may come from several threads (a store locks its own index); a key names one segment's content
    (segment_key), so a key held is never different data.

    What kind of store it is (the tier reads these; fixed for a store's life but `readonly`):
      readonly       puts are refused: another process writes the store (DiskStore without its namespace's
                     lock). Such a store also has scan() and take_over(): the tier's index rescans it on a
                     miss (segments/index.py)
      shared         other processes write into it too (Redis): a node's segment may be held without this
                     process writing it (the tier asks `info` before writing), and a held segment whose parent
                     this process does not know is not an orphan (never removed at start-up)
      write_behind   put only queues the write; a background thread sends it (Redis). The tier then reads
                     every segment of a path before putting the first, and counts its puts as queued;
                     counted("written") is how many landed

    Writes and reads:
      put(segment) -> bool      held under segment.key (readable here from the moment it returns); a key
                                already holding everything segment holds is only touched. False when refused
                                or failed (counted in `faults`), nothing else lost
      read(key) -> Segment | Unreadable   the fully verified segment, or why not: "evicted" (not held, or its
                                bytes gone), "corrupt" (failed verification: dropped, `on_evict` told) or
                                "unavailable" (the store did not answer: the key stays held). Never wrong
                                data. A store that reads into a reuse buffer (DiskStore) also takes
                                read(key, buffer): the bytes are then valid until that buffer's next read
      pin(key) -> bool / unpin(key)   a pinned key is never evicted (pins nest); pin of a key not held
                                takes no pin and says False; unpin without a pin is a ValueError
      info(key) -> SegmentInfo | None   what the store knows of a held key, without reading it
      keys() -> list[bytes]     the held keys, least recently used first (a copy: safe to iterate)
      get_tokens(key) -> tuple[int, ...] | None   a held segment's tokens alone (the tier's start-up walk)
      remove_unreachable(keys) -> int   delete held segments the tier found orphaned at start-up (their
                                chain is gone); the bytes freed. Never asked of a shared store
      on_evict                  set by the tier's index: told (outside the store's locks) of every key that
                                left the store without the tier asking (budget eviction, a bad value found,
                                a write-behind that failed)

    What the cache reports and checks:
      len(store), used_bytes, effective_budget_bytes (None: no bound), faults (reason -> count),
      check_integrity() (AssertionError when its bookkeeping is inconsistent), close() (idempotent)
    """

    readonly: bool
    shared: bool
    write_behind: bool
    on_evict: Callable[[bytes], None] | None
    used_bytes: int
    effective_budget_bytes: int | None
    faults: dict[str, int]

    def put(self, segment: Segment) -> bool: ...

    def read(self, key: bytes) -> Segment | Unreadable: ...

    def pin(self, key: bytes) -> bool: ...

    def unpin(self, key: bytes) -> None: ...

    def info(self, key: bytes) -> SegmentInfo | None: ...

    def keys(self) -> list[bytes]: ...

    def get_tokens(self, key: bytes) -> tuple[int, ...] | None: ...

    def remove_unreachable(self, keys: list[bytes]) -> int: ...

    def __len__(self) -> int: ...

    def check_integrity(self) -> None: ...

    def close(self) -> None: ...
