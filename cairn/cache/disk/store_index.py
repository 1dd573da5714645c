"""StoreIndex: the DiskStore's index of its segment files: which are indexed, least recently used first, the bytes
they take, and the counts of segments entering and leaving it.

    rebuild(found)          a scan's entries replace the index (keys indexed before keep their recency)
    touch / drop / remove   a segment used, found bad or gone (counted "dropped"), deleted (counted by the caller's
                            reason: evictions, removed)
    reserve / commit        a put's bytes set aside before its file is written, then its entry indexed
    plan_eviction(...)      the least recently used keys to delete so that a put fits a budget

`info(key)` is what it knows of one (a `SegmentInfo`, segments/store.py: the type every segment store's `info`
returns). `used_bytes` is the sum of the indexed sizes, plus the bytes a put in flight reserved.
The counts (COUNTS) always add up to the segments indexed:

    len(index) == scanned + puts - rewrites - evictions - removed - dropped      (check_integrity)

What this is not: thread-safe (the store's lock guards every call), the files (the store deletes and writes
them: store.py, namespace.py), or the choice of a budget (the store's, and space.py's effective budget).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from cairn.cache.disk.entries import IndexEntry
from cairn.cache.segments.segment import SegmentHeader
from cairn.cache.segments.store import SegmentInfo

# The store's counts (stats()), since it opened.
COUNTS = (
    "puts",       # segment files written (a put of a key whose file already holds it all writes nothing)
    "rewrites",   # of those, files that replaced an indexed key's file (a snapshot or logits added)
    "evictions",  # indexed segments deleted to fit the budget (least recently used first)
    "removed",    # indexed segments deleted as unreachable (remove_unreachable: orphans found at start-up)
    "dropped",    # indexed segments dropped because their file was found bad, or gone (another process)
    "scanned",    # segments a scan indexed that were not indexed before (start-up, a rescan)
    "gets", "hits",  # get() calls, and those that returned a segment
)


class StoreIndex:
    def __init__(self):
        self._entries: OrderedDict[bytes, IndexEntry] = OrderedDict()  # least recently used first
        self.used_bytes = 0  # sum of indexed sizes, plus the size of a put in flight
        self.counts = dict.fromkeys(COUNTS, 0)  # see COUNTS

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        """The keys, least recently used first."""
        return iter(self._entries)

    def get(self, key: bytes) -> IndexEntry | None:
        return self._entries.get(key)

    def info(self, key: bytes) -> SegmentInfo | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        h = entry.header
        return SegmentInfo(key=h.key, parent_key=h.parent_key, start_position=h.start_position,
                           num_tokens=h.num_tokens, has_snapshot=h.has_snapshot, has_logits=h.has_logits,
                           size_bytes=entry.size_bytes, last_used=entry.last_used)

    def bytes_of(self, keys: Callable[[bytes], bool]) -> int:
        """The bytes of the indexed segments whose key `keys` selects."""
        return sum(e.size_bytes for k, e in self._entries.items() if keys(k))

    # ---- scans ----------------------------------------------------------------------------------------

    def rebuild(self, found: dict[bytes, IndexEntry]) -> list[bytes]:
        """Index exactly `found` (a scan's entries, by key): a key indexed before keeps its last use (and its rank
        among equal ones), a new one its file's mtime (counted "scanned"); returns the keys indexed before and not
        found (another process removed them: counted "dropped")."""
        rank = {key: i for i, key in enumerate(self._entries)}
        for key, entry in found.items():
            if key in self._entries:
                entry.last_used = self._entries[key].last_used
        order = sorted(found.values(), key=lambda e: (e.last_used, rank.get(e.header.key, -1), e.header.key))
        vanished = [key for key in self._entries if key not in found]
        self.counts["scanned"] += sum(key not in self._entries for key in found)
        self.counts["dropped"] += len(vanished)
        self._entries = OrderedDict((e.header.key, e) for e in order)
        self.used_bytes = sum(e.size_bytes for e in order)
        return vanished

    # ---- one segment --------------------------------------------------------------------------------

    def touch(self, key: bytes, now: float) -> None:
        """key (when indexed) was used at wall-clock time `now`: the most recently used."""
        if key in self._entries:
            self._entries[key].last_used = now
            self._entries.move_to_end(key)

    def drop(self, key: bytes) -> bool:
        """Unindex a key whose file was found bad or gone (counted "dropped"); False when it was not indexed."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used_bytes -= entry.size_bytes
        self.counts["dropped"] += 1
        return True

    def remove(self, key: bytes, count: str) -> int:
        """Unindex a key whose file the caller deletes, counted under `count` (evictions, removed); its bytes."""
        size_bytes = self._entries.pop(key).size_bytes
        self.used_bytes -= size_bytes
        self.counts[count] += 1
        return size_bytes

    def reserve(self, nbytes: int) -> None:
        """Count nbytes more as used (a put's file before it is indexed; negative: give them back)."""
        self.used_bytes += nbytes

    def commit(self, header: SegmentHeader, size_bytes: int, reserved: int, now: float) -> None:
        """Index the file just written for header.key (replacing its older file's entry: a rewrite), most recently
        used; `reserved`: the bytes its put reserved, now counted by the entry instead."""
        old = self._entries.pop(header.key, None)
        self.used_bytes += (size_bytes - old.size_bytes if old else size_bytes) - reserved
        self._entries[header.key] = IndexEntry(header, size_bytes, now)
        self.counts["puts"] += 1
        self.counts["rewrites"] += old is not None

    # ---- the budget ---------------------------------------------------------------------------------

    def plan_eviction(self, need_bytes: int, budget_bytes: int, keep: Callable[[bytes], bool]) -> list[bytes] | None:
        """Least-recently-used keys (never one `keep` names) whose removal makes room for need_bytes within
        budget_bytes. [] when it already fits; None when even evicting every other key would not be enough."""
        excess = self.used_bytes + need_bytes - budget_bytes
        victims = []
        for key, entry in self._entries.items():
            if excess <= 0:
                break
            if not keep(key):
                victims.append(key)
                excess -= entry.size_bytes
        return victims if excess <= 0 else None

    def check_integrity(self) -> None:
        """Raise AssertionError unless used_bytes is the indexed sizes' sum, keys match headers, and the counts
        add up (the module docstring)."""
        assert self.used_bytes == sum(e.size_bytes for e in self._entries.values()), "used_bytes drifted"
        assert all(k == e.header.key for k, e in self._entries.items()), "index key differs from its header"
        c = self.counts
        assert len(self) == (c["scanned"] + c["puts"] - c["rewrites"] - c["evictions"] - c["removed"]
                             - c["dropped"]), f"the counts do not add up to the {len(self)} indexed"
