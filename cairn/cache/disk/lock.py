"""NamespaceLock: whether this process is the one that writes a disk namespace, and if not, why not.

One process at a time holds a namespace's lock (namespace.py's `try_lock`: an flock on its .lock file); it
alone writes, evicts, deletes and moves files there. Any other store on the namespace is read-only: it gets
and scans. `reason` says why a store is read-only, logged once when it opens: another process holds the lock
(HELD_ELSEWHERE), or the lock could not be taken at all (a read-only filesystem, a .lock that is not a file),
counted as the fault "lock_failed". `take_over()` takes the lock once the process that held it is gone (a
rolling restart: the old server stops after the new one started); a lock that could not be taken at all is
not tried again.

This is NOT the store (store.py decides what read-only means for each operation, and serialises the take-over
with its writes) nor the lock file itself (namespace.py).
"""

from __future__ import annotations

import logging
import os

from cairn.cache.disk.faults import FaultLog
from cairn.cache.disk.namespace import LOCK_NAME, try_lock

logger = logging.getLogger(__name__)

HELD_ELSEWHERE = "another process holds its lock"  # reason while a live process holds the lock


class NamespaceLock:
    """The lock of the namespace open as `dir_fd`, taken (or not) at construction. Not thread-safe: the store
    calls take_over and release under its own locks."""

    def __init__(self, dir_fd: int, where: str, faults: FaultLog):
        self.where = where  # "<root>/<digest>", for the log lines
        self.reason: str | None = None  # why the store is read-only (None: this process holds the lock)
        self._fd = self._take(dir_fd, faults)

    def _take(self, dir_fd: int, faults: FaultLog) -> int | None:
        """The lock's fd, or None: read-only, and `reason` (logged once) says why."""
        try:
            fd = try_lock(dir_fd)
        except OSError as e:
            self.reason = f"its lock could not be taken: {e}"
            faults.report("lock_failed", LOCK_NAME, f"{e}; this store is read-only")
            return None
        if fd is None:
            self.reason = HELD_ELSEWHERE
            logger.warning("disk cache %s is read-only: %s", self.where, self.reason)
        return fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take_over(self, dir_fd: int) -> bool:
        """Take the lock if another process held it and is gone; True when it took it (one log line)."""
        if self._fd is not None or self.reason != HELD_ELSEWHERE:
            return False
        try:
            fd = try_lock(dir_fd)
        except OSError:
            return False
        if fd is None:
            return False
        self._fd, self.reason = fd, None
        logger.info("disk cache %s: the process that held its lock is gone; this server writes it from now on",
                    self.where)
        return True

    def release(self) -> None:
        """Let another process take the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
