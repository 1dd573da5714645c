"""KnownSegments: RedisSegmentStore's record of the segments this process knows Redis to hold (those it wrote
or looked up), least recently used first, with their bytes and the chains between them.

    add / restore / touch / resize / remove     keep one segment's record (a new one is the most recently used)
    ending_at(end key)       the known segment whose path ends at a canonical prefix key (a segment's parent)
    chain_of(segment)        the chain a new segment continues, from its parent's record
    ancestors(parent key)    the known segments a new segment chains below, nearest first
    below(key)               a known segment and every known segment chained below it
    least_recent(...)        what to forget to get back within a count and a byte bound (oldest first)
    most_recent(n, ...)      the n most recently used (the epoch's witnesses, epoch.py)

A segment's path is [0, end): its record keeps `end_hash`, the canonical hasher after that whole path (keys.py),
so the canonical key of its end (a child's parent key) finds it again. What this is not: thread-safe (the
store's lock guards every call), a copy of what Redis holds (Redis evicts and expires without telling
anyone), or the choice of when to forget (the store's bounds and faults).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator

from cairn.cache.remote.keys import canonical_hasher
from cairn.cache.segments.segment import Segment, _tokens_to_bytes
from cairn.cache.segments.store import SegmentInfo


@dataclasses.dataclass
class KnownSegment:
    """What the store knows of one segment (its record's entry)."""

    info: SegmentInfo  # what this process knows of the segment
    bounds: tuple[int, ...]  # its chain: 0, each segment's start, its end
    tokens: tuple[int, ...]  # its own tokens, verified against its key
    end_hash: object  # canonical_hasher() after the whole path [0, end)


class KnownSegments:
    def __init__(self):
        self._by_key: OrderedDict[bytes, KnownSegment] = OrderedDict()  # least recently used first
        self._by_end: dict[bytes, bytes] = {}  # canonical key of a segment's end -> its key
        self.num_bytes = 0  # sum of the size_bytes of the records

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[bytes]:
        """The keys, least recently used first."""
        return iter(self._by_key)

    def get(self, key: bytes) -> KnownSegment | None:
        return self._by_key.get(key)

    def ending_at(self, end_key: bytes | None) -> KnownSegment | None:
        """The known segment whose path ends at canonical key `end_key` (None: none, or end_key None)."""
        return self._by_key.get(self._by_end.get(end_key or b"", b""))

    # ---- one record ---------------------------------------------------------------------------------

    def add(self, entry: KnownSegment) -> None:
        """Record entry (replacing what was known of its key), the most recently used."""
        key = entry.info.key
        previous = self._by_key.get(key)
        self.num_bytes += entry.info.size_bytes - (previous.info.size_bytes if previous is not None else 0)
        self._by_key[key] = entry
        self._by_key.move_to_end(key)
        self._by_end[entry.end_hash.digest()] = key

    def restore(self, key: bytes, previous: KnownSegment | None) -> None:
        """Undo add() of key: back to `previous` (what was known of it before; None: nothing)."""
        self.remove(key)
        if previous is not None:
            self.add(previous)

    def touch(self, key: bytes) -> None:
        """key (when known) is now the most recently used."""
        if key in self._by_key:
            self._by_key.move_to_end(key)

    def resize(self, key: bytes, size_bytes: int) -> None:
        """key's stored size is now size_bytes (when known)."""
        entry = self._by_key.get(key)
        if entry is not None:
            self.num_bytes += size_bytes - entry.info.size_bytes
            entry.info = dataclasses.replace(entry.info, size_bytes=size_bytes)

    def remove(self, key: bytes) -> bool:
        """Forget key; False when it was not known."""
        entry = self._by_key.pop(key, None)
        if entry is None:
            return False
        self.num_bytes -= entry.info.size_bytes
        self._by_end.pop(entry.end_hash.digest(), None)
        return True

    # ---- chains -------------------------------------------------------------------------------------

    def chain_of(self, segment: Segment) -> tuple[tuple[int, ...], object, object] | None:
        """(bounds of the chain segment ends, canonical_hasher() after the path before it, and after its end), from
        its parent's record; None when its parent is not known here, or ends elsewhere than where it starts."""
        if segment.start_position == 0:  # a path's first segment: its parent key, when it has one, is its salt key
            bounds, start = (0,), canonical_hasher(segment.parent_key)
        else:
            parent = self.ending_at(segment.parent_key)
            if parent is None or parent.info.start_position + parent.info.num_tokens != segment.start_position:
                return None
            bounds, start = parent.bounds, parent.end_hash
        end = start.copy()
        end.update(_tokens_to_bytes(segment.tokens))
        return bounds + (segment.end_position,), start, end

    def ancestors(self, parent_key: bytes | None) -> tuple[bytes, ...]:
        """Keys of the known segments a segment whose parent key is `parent_key` chains below, nearest first (up
        to the first not known here)."""
        keys, end = [], parent_key
        while end is not None and (entry := self.ending_at(end)) is not None:
            keys.append(entry.info.key)
            end = entry.info.parent_key
        return tuple(keys)

    def below(self, key: bytes) -> list[bytes]:
        """key and the keys of every known segment chained below it ([] when key is not known)."""
        if key not in self._by_key:
            return []
        ends, keys = {self._by_key[key].end_hash.digest()}, [key]
        for entry in sorted(self._by_key.values(), key=lambda e: e.info.start_position):  # parents first
            if entry.info.parent_key in ends:
                ends.add(entry.end_hash.digest())
                keys.append(entry.info.key)
        return keys

    # ---- bounds -------------------------------------------------------------------------------------

    def least_recent(self, max_segments: int, max_bytes: int | None, skip: Callable[[bytes], bool]) -> list[bytes]:
        """The least recently used keys to forget so that at most max_segments records of at most max_bytes
        (None: no byte bound) remain, passing over those `skip` keeps; fewer when the kept ones alone exceed."""
        excess = len(self._by_key) - max_segments
        excess_bytes = 0 if max_bytes is None else self.num_bytes - max_bytes
        keys = []
        for key, entry in self._by_key.items():  # least recently used first
            if excess <= 0 and excess_bytes <= 0:
                break
            if not skip(key):
                keys.append(key)
                excess, excess_bytes = excess - 1, excess_bytes - entry.info.size_bytes
        return keys

    def most_recent(self, n: int, skip: Callable[[bytes], bool]) -> list[bytes]:
        """The n most recently used keys (most recent first), passing over those `skip` names."""
        keys = []
        for key in reversed(self._by_key):
            if len(keys) == n:
                break
            if not skip(key):
                keys.append(key)
        return keys

    def check_integrity(self) -> None:
        assert all(k == e.info.key for k, e in self._by_key.items()), "record key differs from its entry"
        assert self.num_bytes == sum(e.info.size_bytes for e in self._by_key.values()), "known bytes drifted"
