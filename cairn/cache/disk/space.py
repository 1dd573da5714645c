"""FilesystemRoom: how much of a disk store's budget its filesystem can hold (the effective budget).

The budget (--disk-cache-gib) is what the operator allows; the filesystem may hold less: other files grew, or
the budget exceeded the free space from the start (one start-up warning, `warn_if_short`). A write that fails
with ENOSPC (or a quota's EDQUOT) while the free space explains it lowers the effective budget to what fits,
the store's files plus the free space (`found_full`; one WARNING line when it first drops below the budget).
While it is lowered, a write that would evict under it measures again (`remeasure`), so the effective budget
follows the free space back up (one INFO line once it is the whole budget again) or further down. The free
space is the namespace directory's filesystem's (os.fstatvfs), less the rounding of the file to be written up
to whole blocks.

This is NOT eviction nor the fault counts (store.py evicts down to `effective_bytes`, counts "disk_full" and
decides whether to write again), and it writes nothing. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil

logger = logging.getLogger(__name__)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a write found the filesystem (or the user's quota) full


def format_size(num_bytes: int) -> str:
    """A byte count for a log line: in GiB from 1 GiB up, else in MiB (a budget of 0.01 GiB is "10.2 MiB")."""
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


class FilesystemRoom:
    """The effective budget of the store whose namespace is open as `dir_fd` under `root` (`name`: the short
    namespace id its log lines start with)."""

    def __init__(self, dir_fd: int, root: str, name: str, budget_bytes: int):
        self._dir_fd, self.root, self.name, self.budget_bytes = dir_fd, root, name, budget_bytes
        self.effective_bytes = budget_bytes  # <= budget_bytes: what the filesystem was last found to hold

    @property
    def short(self) -> bool:
        """The filesystem was found to hold less than the budget."""
        return self.effective_bytes < self.budget_bytes

    def warn_if_short(self, held_bytes: int) -> None:
        """One start-up warning when the budget is more than the filesystem has room for (its free space plus
        the `held_bytes` the store already holds). Nothing is refused: a full disk is met as found_full says."""
        try:
            free_bytes = shutil.disk_usage(self.root).free
        except OSError:
            return
        if self.budget_bytes > free_bytes + held_bytes:
            held = f" (besides the {format_size(held_bytes)} it holds)" if held_bytes else ""
            logger.warning("disk cache %s: the budget of %s exceeds the %s free on its filesystem%s; when it is "
                           "full, the least recently used segments make room for new ones",
                           self.root, format_size(self.budget_bytes), format_size(free_bytes), held)

    def found_full(self, error: Exception, held_bytes: int, size_bytes: int) -> int | None:
        """After a write of size_bytes failed with `error`, beside the held_bytes of the store's files: when it is
        ENOSPC or EDQUOT and the free space explains it, the effective budget lowered to what the filesystem
        holds (returned; one line when it first drops below the budget). None when the failure is not for want
        of bytes (another error, out of inodes, the space came back meanwhile): nothing changes."""
        if not (isinstance(error, OSError) and error.errno in NO_SPACE):
            return None
        fits = self._bytes_that_fit(held_bytes, size_bytes)
        if fits is None or fits >= held_bytes + size_bytes:
            return None
        if not self.short:
            logger.warning("disk cache %s: the filesystem under %s is full (%s): it has room for %s of segments, "
                           "less than the budget of %s; evicting the least recently used to fit what it holds, "
                           "until space comes back", self.name, self.root, error.strerror, format_size(fits),
                           format_size(self.budget_bytes))
        self.effective_bytes = min(self.budget_bytes, fits)
        return self.effective_bytes

    def remeasure(self, held_bytes: int, size_bytes: int) -> None:
        """Measure again, before evicting for a write under a lowered budget: the effective budget follows the
        free space back up (one line when it is the whole budget again), or down."""
        fits = self._bytes_that_fit(held_bytes, size_bytes)
        if fits is None:
            return
        self.effective_bytes = min(self.budget_bytes, fits)
        if not self.short:
            logger.info("disk cache %s: the filesystem under %s has room again; the budget is %s again",
                        self.name, self.root, format_size(self.budget_bytes))

    def _bytes_that_fit(self, held_bytes: int, size_bytes: int) -> int | None:
        """The segment bytes the filesystem can hold with a write of size_bytes next: the store's files plus the
        free space, less what rounding that file up to whole blocks takes; None when it cannot be measured."""
        try:
            fs = os.fstatvfs(self._dir_fd)
        except OSError:
            return None
        block = fs.f_frsize or 4096
        return max(0, held_bytes + fs.f_bavail * block - (-size_bytes % block))
