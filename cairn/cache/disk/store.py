"""The disk tier's live segment store: one model namespace's segments, indexed, within a byte budget.

`DiskStore` puts and gets `Segment`s by key (LRU eviction, pins), writes atomically, indexes the
namespace at start-up from headers only, verifies every checksum on `get`, turns every bad file into
a counted miss, and counts every refusal in `faults` (faults.py: each logged with the file it concerns,
each reason at most once a minute). The on-disk layout, safe file primitives live in namespace.py, which
process writes the namespace (its lock, read-only stores, the take-over) in lock.py, how much of the budget
a filling filesystem holds (the effective budget) in space.py, which directory entries a scan indexes and
what becomes of a bad file (deleted, set aside, remembered) in entries.py, the index's bookkeeping (recency,
bytes, the counts of segments entering and leaving it) in store_index.py, the `cairn cache ls|verify|purge`
helpers (`list_namespaces`, `verify_store`, `purge_namespace`, re-exported here) in offline.py.

This module is NOT the file format (segment.py), the tensor conversion, nor the tier policy (what
to demote or prefetch, when to read): it stores and returns bytes.

Thread safety: calls may come from several threads; puts and scans are serialised, and the index is
only mutated under a lock. A get that races an eviction returns None, never wrong data.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable

from cairn.cache.disk.entries import DirectoryEntries
from cairn.cache.disk.faults import FaultLog
from cairn.cache.disk.lock import NamespaceLock
from cairn.cache.disk.namespace import (
    DiskStoreError,
    ReadBuffer,
    StoreLockedError,
    UnusableEntry,
    open_namespace,
    read_segment_file,
    read_segment_tokens,
    segment_file_name,
    unlink_ours,
    write_atomic,
    write_model_name,
)
from cairn.cache.disk.offline import NamespaceSummary, VerifyResult, list_namespaces, purge_namespace, verify_store
from cairn.cache.disk.space import FilesystemRoom, format_size
from cairn.cache.disk.store_index import StoreIndex
from cairn.cache.segments.decode import read_header
from cairn.cache.segments.pins import Pins
from cairn.cache.segments.segment import (
    DEFAULT_LIMITS,
    Segment,
    SegmentError,
    SegmentHeader,
    SegmentLimits,
    encode_segment_parts,
)
from cairn.cache.segments.store import SegmentInfo

__all__ = ["DiskStore", "DiskStoreError", "StoreLockedError", "NamespaceSummary", "VerifyResult",
           "list_namespaces", "verify_store", "purge_namespace", "format_size"]

logger = logging.getLogger(__name__)
FULL_DISK_RETRIES = 2  # writes again after evicting to fit what a full filesystem holds (bounded: others may fill it)


class DiskStore(Pins):
    """Segments of one model namespace on disk, within `budget_bytes`: a `SegmentStore` (segments/store.py) that
    one process writes (the namespace's lock holder), each put durable when it returns.

    Contracts:
      put(segment)   True once the complete file is durable under its final name and indexed; False
                     (counted in `faults`) when refused or failed, with nothing else lost.
      get(key)       the fully verified segment, or None (miss, or a bad file: counted, dropped
                     from the index, deleted when it is our regular file). Never wrong data.
      pin / unpin    a pinned key is never evicted (pins nest); a pin does not keep a bad file.
      on_evict(key)  called, outside the store's locks, whenever an indexed key leaves the index
                     without the caller asking: budget eviction or a bad file found by get.
      remove_unreachable(keys)  delete segments the tier found orphaned at start-up.
    A store that cannot take the namespace's lock is read-only (`readonly_reason`: another process holds
    it, or it could not be taken, and why): it gets and scans, never writes, evicts, deletes or moves.
    `take_over()` takes the lock once the process that held it is gone (a rolling restart: the old
    server stops after the new one started), and the store is the lock holder from then on.
    used_bytes <= budget_bytes always holds for the lock holder.
    A full disk: a write that fails with ENOSPC (or EDQUOT) for want of free space lowers the effective budget
    (`effective_budget_bytes`) to what the filesystem holds (counted as "disk_full", one line), evicts down
    to it, least recently used and unpinned first, and writes again (at most FULL_DISK_RETRIES times); a
    later write that would evict under it measures the free space again, so the budget comes back with the
    space. A segment that cannot fit even with every unpinned segment evicted fails ("write_failed") with
    nothing evicted for it.
    Bad files: the lock holder deletes a corrupt segment of ours and moves an entry named like a
    segment that is not a regular file (a link, a FIFO...) into quarantine/, so neither is met again
    at the next start; a read-only store remembers the files it rejected and skips them on a rescan.
    """

    shared = False  # one process writes a namespace: what is not indexed here is not on disk (a rescan aside)
    write_behind = False  # a put has written its file when it returns

    def __init__(self, root, compat_digest: str, budget_bytes: int, *, compression: str | None = None,
                 limits: SegmentLimits = DEFAULT_LIMITS, on_evict: Callable[[bytes], None] | None = None,
                 create_parents: bool = False, model_name: str | None = None):
        if compression not in (None, "zstd", "lz4"):  # the command line's choices; the Python API reaches here
            raise ValueError(f"compression must be None, 'zstd' or 'lz4', got {compression!r}")
        assert budget_bytes >= 0, "CacheOptions refuses a negative disk_cache_gib first"
        self.root, self.compat_digest, self.budget_bytes = os.fspath(root), compat_digest, budget_bytes
        self.compression, self.limits, self.on_evict = compression, limits, on_evict
        self._faults = FaultLog(f"disk cache {compat_digest[:16]}", logger)  # counts and logs every refusal
        self._index = StoreIndex()  # the indexed segments, their bytes and counts (store_index.py)
        self._pins: dict[bytes, int] = {}  # key -> pin count (> 0)
        self._lock = threading.RLock()  # guards everything above
        self._put_lock = threading.Lock()  # serialises puts and scans (the only writers of files)
        self._dir_fd = open_namespace(self.root, compat_digest, create=True, create_parents=create_parents)
        self._entries = DirectoryEntries(self._dir_fd, compat_digest, limits, self._faults, lambda: self.readonly)
        self._room = FilesystemRoom(self._dir_fd, self.root, compat_digest[:16], budget_bytes)  # see space.py
        self._model_name = model_name
        self._ns_lock: NamespaceLock | None = None  # this process writes the namespace while it holds it
        try:
            self._ns_lock = NamespaceLock(self._dir_fd, f"{self.root}/{compat_digest}", self._faults)
            if model_name is not None and not self.readonly:
                write_model_name(self._dir_fd, model_name)
            self.scan()
        except BaseException:
            self.close()
            raise
        if not self.readonly:
            self._room.warn_if_short(self._index.used_bytes)

    def take_over(self) -> bool:
        """Take the lock that another process held when this store opened, if that process is gone (lock.py):
        from then on this store writes, evicts and deletes (the caller scans next, which cleans and fits the
        budget as the lock holder does). True when it took it."""
        with self._put_lock, self._lock:
            if not self._ns_lock.take_over(self._dir_fd):
                return False
        if self._model_name is not None:
            write_model_name(self._dir_fd, self._model_name)
        return True

    @property
    def effective_budget_bytes(self) -> int:
        """The budget evictions fit: budget_bytes, or less while the filesystem holds less (space.py)."""
        return self._room.effective_bytes

    @property
    def readonly(self) -> bool:
        return self._ns_lock is None or not self._ns_lock.held

    @property
    def readonly_reason(self) -> str | None:
        """Why the store is read-only (lock.py), or None: it holds the namespace's lock."""
        return None if self._ns_lock is None else self._ns_lock.reason

    @property
    def faults(self) -> dict[str, int]:
        """reason -> occurrences of every refusal and bad file met (cairn_cache_disk_faults_total{reason})."""
        return self._faults.counts

    def _check_open(self) -> None:
        assert self._dir_fd is not None, "the engine closes the cache once, at shutdown, and calls it no more"

    # ------------------------------------------------------------------------------------ scan

    def scan(self) -> None:
        """(Re)build the index from the namespace directory, validating headers and end markers only.

        The lock holder also removes leftover temp files and bad files of ours, then evicts down
        to the budget. Keys already indexed keep their recency; new ones take their file mtime.
        """
        with self._put_lock:
            self._check_open()
            found = {}
            for name in sorted(os.listdir(self._dir_fd)):
                entry = self._entries.read(name, self._index.get)
                if entry is not None:
                    found[entry.header.key] = entry
            with self._lock:
                vanished = self._index.rebuild(found)  # another process removed them
                evicted = [] if self.readonly else self._fit_budget()
        self._notify(vanished + evicted)

    def _fit_budget(self) -> list[bytes]:
        """Evict least-recently-used unpinned segments until the index fits the budget (at start-up: a budget
        smaller than what the directory holds), with one INFO line saying what that freed. Caller holds
        self._lock; returns the evicted keys."""
        victims = self._plan_eviction(0, None) or []
        if victims:
            freed_bytes = sum(self._index.get(key).size_bytes for key in victims)
            logger.info("disk cache %s: evicted %d segment(s), %s, to fit the budget of %s",
                        self.compat_digest[:16], len(victims), format_size(freed_bytes),
                        format_size(self._room.effective_bytes))
        return self._evict(victims)

    # ------------------------------------------------------------------------------------ reads

    def get(self, key: bytes, buffer: ReadBuffer | None = None) -> Segment | None:
        """The segment stored under key, with every checksum verified, or None (see class docstring).
        With `buffer`, its bytes are read into it and valid until that buffer's next read."""
        got = self.read(key, buffer)
        return got if isinstance(got, Segment) else None

    def read(self, key: bytes, buffer: ReadBuffer | None = None) -> Segment | str:
        """get's segment, or why there is none: "evicted" (not indexed, or its file gone) or "corrupt" (it failed
        verification, is not a regular file, or could not be read)."""
        with self._lock:
            self._check_open()
            self._index.counts["gets"] += 1
        segment = self._read(key, functools.partial(read_segment_file, buffer=buffer))
        if isinstance(segment, Segment):
            with self._lock:
                self._index.counts["hits"] += 1
                self._index.touch(key, time.time())
        return segment

    def get_tokens(self, key: bytes) -> tuple[int, ...] | None:
        """The verified tokens of the segment stored under key (header and tokens section only), or None
        (a miss, or a bad file: counted, dropped from the index). Used to index the store at start-up."""
        with self._lock:
            self._check_open()
        tokens = self._read(key, read_segment_tokens)
        return None if isinstance(tokens, str) else tokens

    def _read(self, key: bytes, reader: Callable):
        """reader(dir_fd, name, digest, limits) on key's file, or why not: "evicted" (not indexed, or the file
        vanished) or "corrupt" (a bad or unreadable file); either is rejected (counted, unindexed; ours deleted
        when damaged, moved aside when not a regular file)."""
        with self._lock:
            if key not in self._index:
                return "evicted"
        name = segment_file_name(key)
        try:
            return reader(self._dir_fd, name, self.compat_digest, self.limits)
        except (SegmentError, UnusableEntry) as e:
            corrupt = isinstance(e, SegmentError)  # our file, damaged: delete it; else not a file: move it
            self._reject(key, e.reason, e.message if corrupt else "", delete=corrupt, set_aside=not corrupt)
        except FileNotFoundError:
            self._reject(key, "missing", "", delete=False)
            return "evicted"
        except OSError as e:
            self._reject(key, "read_failed", str(e), delete=False)
        return "corrupt"

    def _reject(self, key: bytes, reason: str, detail: str, delete: bool, set_aside: bool = False) -> None:
        """Count a bad or vanished file, drop it from the index, and delete it (or move it aside) when it
        is ours; a read-only store remembers it so that a rescan does not index it again."""
        name = segment_file_name(key)
        self._faults.report(reason, name, detail)
        with self._lock:
            dropped = self._index.drop(key)
        self._entries.reject(name, delete, set_aside)
        self._notify([key] if dropped else [])

    def info(self, key: bytes) -> SegmentInfo | None:
        with self._lock:
            return self._index.info(key)

    def keys(self) -> list[bytes]:
        """Indexed keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def segment_counts(self) -> dict[str, int]:
        """The COUNTS of segments entering and leaving the index (all but gets and hits), for /metrics."""
        with self._lock:
            return {name: n for name, n in self._index.counts.items() if name not in ("gets", "hits")}

    def stats(self) -> dict:
        """segments (indexed now), used_bytes, budget_bytes, readonly, and the COUNTS."""
        with self._lock:
            return {"segments": len(self._index), "used_bytes": self._index.used_bytes,
                    "budget_bytes": self.budget_bytes, **self._index.counts, "readonly": self.readonly}

    # pin / unpin: see pins.py

    # ------------------------------------------------------------------------------------ writes

    def put(self, segment: Segment) -> bool:
        """Store segment under segment.key, evicting least-recently-used unpinned segments to fit.

        An indexed key whose file already holds everything segment holds (snapshot, logits) is only
        touched. False, counted, when: read-only ("readonly"), larger than the budget or the limits
        ("too_large"), pins leave too little room ("budget_full"), the name is taken by a non-file
        ("name_taken"), or the write fails ("write_failed"). Raises ValueError on an invalid segment.
        """
        with self._put_lock:
            ok, evicted = self._put_locked(segment)
        self._notify(evicted)
        return ok

    def _put_locked(self, segment: Segment) -> tuple[bool, list[bytes]]:
        with self._lock:
            self._check_open()
            if self.readonly:
                self._faults.count("readonly")  # the start-up warning says why every put is refused
                return False, []
            entry = self._index.get(segment.key)
            if entry is not None and _covers(entry.header, segment):
                self._index.touch(segment.key, time.time())
                return True, []
        try:
            parts = encode_segment_parts(segment, self.compat_digest, self.compression, self.limits)
        except SegmentError as e:
            self._faults.report("too_large", segment_file_name(segment.key), e.message)
            return False, []
        size_bytes, name, evicted = sum(memoryview(p).nbytes for p in parts), segment_file_name(segment.key), []
        for attempt in range(1 + FULL_DISK_RETRIES):
            reservation = self._reserve(segment.key, size_bytes)
            if reservation is None:
                return False, evicted
            evicted += reservation[0]
            error = self._write(name, parts)
            if error is None:
                self._commit(segment, parts[0], size_bytes, reservation[1])
                return True, evicted
            with self._lock:
                self._index.reserve(-reservation[1])
            if attempt == FULL_DISK_RETRIES or not self._made_room(error, segment.key, size_bytes):
                self._faults.report(getattr(error, "reason", "write_failed"), name,
                                    "" if isinstance(error, UnusableEntry) else str(error))
                return False, evicted
        raise AssertionError("unreachable: the last attempt returns")

    def _write(self, name: str, parts) -> OSError | UnusableEntry | None:
        """Write the file atomically; the error that failed it, or None."""
        try:
            if not write_atomic(self._dir_fd, name, parts):
                self._faults.report("dir_sync_failed", name, "the directory fsync failed after the rename")
        except (OSError, UnusableEntry) as e:
            return e
        return None

    def _made_room(self, error: Exception, key: bytes, size_bytes: int) -> bool:
        """The write failed for want of free space (space.py): the effective budget is lowered to what the
        filesystem holds (counted as "disk_full"); True: evict down to it and write again. False, nothing
        evicted for it, when the failure is another, or when even evicting every unpinned segment would not
        make room: the write fails as any other."""
        with self._lock:
            fits = self._room.found_full(error, self._index.used_bytes, size_bytes)
            if fits is None:
                return False
            self._faults.count("disk_full")
            kept = self._index.bytes_of(lambda k: k in self._pins or k == key)
        return kept + size_bytes <= fits

    def _reserve(self, key: bytes, size_bytes: int) -> tuple[list[bytes], int] | None:
        """Evict to make room for size_bytes under key and count them as used.

        Returns (evicted keys, bytes added to used_bytes), or None (counted) when it cannot fit.
        """
        with self._lock:
            old = self._index.get(key).size_bytes if key in self._index else 0
            if size_bytes > self.budget_bytes:
                self._faults.report("too_large", segment_file_name(key),
                                    f"{size_bytes} bytes > budget {self.budget_bytes}")
                return None
            used = self._index.used_bytes
            if self._room.short and used + size_bytes - old > self._room.effective_bytes:
                self._room.remeasure(used, size_bytes)
            full = self._room.short
            # On a full disk the old file takes its room until the new one is renamed over it.
            victims = self._plan_eviction(size_bytes if full else size_bytes - old, exclude=key)
            if victims is None:
                room = f" in the {format_size(self._room.effective_bytes)} the full filesystem holds" if full else ""
                self._faults.report("budget_full", segment_file_name(key),
                                    f"pinned segments leave too little room{room}")
                return None
            self._index.reserve(size_bytes - old)
            return self._evict(victims), size_bytes - old

    def _commit(self, segment: Segment, header_bytes: bytes, size_bytes: int, reserved: int) -> None:
        header = read_header(header_bytes, self.compat_digest, size_bytes, self.limits)
        with self._lock:
            self._index.commit(header, size_bytes, reserved, time.time())

    def _plan_eviction(self, need_bytes: int, exclude: bytes | None) -> list[bytes] | None:
        """Least-recently-used unpinned keys (never `exclude`) whose removal makes room for need_bytes within the
        effective budget ([] when it fits; None when it cannot)."""
        return self._index.plan_eviction(need_bytes, self._room.effective_bytes,
                                         lambda key: key == exclude or key in self._pins)

    def _evict(self, victims: list[bytes], count: str = "evictions") -> list[bytes]:
        """Drop victims from the index and delete their files, counted under `count` (caller holds self._lock)."""
        for key in victims:
            self._index.remove(key, count)
            unlink_ours(self._dir_fd, segment_file_name(key))
        return victims

    def remove_unreachable(self, keys: list[bytes]) -> int:
        """Delete indexed segments the caller found unreachable (an orphan: the chain above it is gone), so that
        they stop taking the budget and being scanned; returns the bytes freed. The lock holder only, pinned
        keys kept; nobody is notified (nothing hung them on a tree)."""
        if self.readonly:
            return 0
        freed = 0
        with self._lock:
            for key in keys:
                if key in self._index and key not in self._pins:
                    freed += self._index.get(key).size_bytes
                    self._evict([key], "removed")
        return freed

    def _notify(self, keys: list[bytes]) -> None:
        if self.on_evict is not None:
            for key in keys:
                self.on_evict(key)

    # ------------------------------------------------------------------------------------ lifetime

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call it after each step)."""
        with self._lock:
            self._index.check_integrity()
            assert self.readonly or self._index.used_bytes <= self.budget_bytes, "over budget"
            assert self._room.effective_bytes <= self.budget_bytes, "an effective budget above the budget"
            assert all(n > 0 for n in self._pins.values()), "non-positive pin count"

    def close(self) -> None:
        """Release the lock (another process may then manage the namespace) and the directory. Idempotent."""
        with self._put_lock, self._lock:
            if self._ns_lock is not None:
                self._ns_lock.release()
            if self._dir_fd is not None:
                os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _covers(header: SegmentHeader, segment: Segment) -> bool:
    """The stored file already holds everything `segment` would add."""
    has_snapshot = header.has_snapshot or segment.snapshot_bytes is None
    return has_snapshot and (header.has_logits or segment.logits_bytes is None)
