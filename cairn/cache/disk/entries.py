"""The namespace directory's entries as the store's index sees them, one name at a time.

`DirectoryEntries.read(name, indexed)` is a scan's look at one directory entry: a segment file to index
(its header and end marker validated: an `IndexEntry`), the indexed entry itself when the file is the
one indexed (same size and mtime: not read again), or None for a name to skip (the lock, the model name,
quarantine/, a leftover temp file the lock holder removes, a foreign name) and for a bad file. A bad file
is counted in `faults`; `reject(name, ...)` (the scan's, and the store's when a read finds one) deletes it
when it is a damaged file of ours, moves a non-regular entry into quarantine/, and remembers it (inode and
mtime), so that a read-only store, which may do neither, skips it at every rescan until it changes.

What this is not: the index, its budget or its locks (store.py, store_index.py), the file primitives (namespace.py).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from cairn.cache.disk.faults import FaultLog
from cairn.cache.disk.namespace import (
    LOCK_NAME,
    MODEL_NAME,
    QUARANTINE_NAME,
    SEGMENT_NAME,
    TEMP_NAME,
    UnusableEntry,
    read_index_header,
    set_aside,
    unlink_ours,
)
from cairn.cache.segments.segment import SegmentError, SegmentHeader, SegmentLimits


@dataclass
class IndexEntry:
    header: SegmentHeader  # the validated header of the indexed file
    size_bytes: int  # file size
    last_used: float  # wall-clock seconds of the last get/put in this process (file mtime at scan)
    mtime_ns: int = 0  # the file's mtime when scanned (0: written here); a rescan skips an unchanged file


class DirectoryEntries:
    """Reads and rejects the entries of one namespace directory (`dir_fd`) for its store; `readonly()` says
    whether the store may remove or move files (it holds the namespace's lock)."""

    def __init__(self, dir_fd: int, compat_digest: str, limits: SegmentLimits, faults: FaultLog,
                 readonly: Callable[[], bool]):
        self._dir_fd, self._compat_digest, self._limits = dir_fd, compat_digest, limits
        self._faults, self._readonly = faults, readonly
        self._rejected: dict[str, tuple[int, int]] = {}  # file name -> (inode, mtime ns) of a file found bad

    def read(self, name: str, indexed: Callable[[bytes], IndexEntry | None]) -> IndexEntry | None:
        """The entry to index for `name` (None: skip it; see the module docstring); `indexed(key)`: the
        store's current entry for a key, reused when the file is unchanged."""
        if name in (LOCK_NAME, MODEL_NAME, QUARANTINE_NAME) or self._is_rejected(name):
            return None
        if TEMP_NAME.fullmatch(name):
            if not self._readonly() and unlink_ours(self._dir_fd, name):
                self._faults.report("stale_temp", name)
            return None
        if not SEGMENT_NAME.fullmatch(name):
            self._faults.report("foreign_name", name)
            return None
        if (known := self._unchanged(name, indexed(bytes.fromhex(name.removesuffix(".seg"))))) is not None:
            return known
        try:
            header, st = read_index_header(self._dir_fd, name, self._compat_digest, self._limits)
        except UnusableEntry as e:
            self._faults.report(e.reason, name)
            self.reject(name, delete=False, set_aside=True)
        except SegmentError as e:
            self._faults.report(e.reason, name, e.message)
            self.reject(name, delete=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._faults.report("read_failed", name, str(e))
        else:
            return IndexEntry(header, st.st_size, st.st_mtime, st.st_mtime_ns)
        return None

    def reject(self, name: str, delete: bool, set_aside: bool = False) -> None:
        """A bad (or vanished) file, already counted: remembered, and deleted (`delete`: a damaged file of
        ours) or moved into quarantine/ (`set_aside`: not a regular file) when this store may."""
        self._remember(name)
        if delete and not self._readonly():
            unlink_ours(self._dir_fd, name)
        elif set_aside:
            self._set_aside(name)

    def _unchanged(self, name: str, entry: IndexEntry | None) -> IndexEntry | None:
        """`entry` when `name`'s file is the one it indexed (same size and mtime)."""
        if entry is None or not entry.mtime_ns:
            return None
        try:
            st = os.lstat(name, dir_fd=self._dir_fd)
        except OSError:
            return None
        same = stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns) == (entry.size_bytes, entry.mtime_ns)
        return entry if same else None

    def _is_rejected(self, name: str) -> bool:
        """A file found bad before and unchanged since (a read-only store cannot remove it)."""
        if name not in self._rejected:
            return False
        try:
            st = os.lstat(name, dir_fd=self._dir_fd)
        except OSError:
            return False
        return self._rejected[name] == (st.st_ino, st.st_mtime_ns)

    def _remember(self, name: str) -> None:
        with suppress(OSError):
            st = os.lstat(name, dir_fd=self._dir_fd)
            self._rejected[name] = (st.st_ino, st.st_mtime_ns)

    def _set_aside(self, name: str) -> None:
        """The lock holder moves a non-regular entry into quarantine/ (counted when that fails)."""
        if not self._readonly() and not set_aside(self._dir_fd, name):
            self._faults.report("quarantine_failed", name)
