"""FaultLog: the disk store's fault counters and their log lines, bounded in number.

Every fault is counted under its reason (`counts`: the store's `faults`, exported as
cairn_cache_disk_faults_total{reason}). The first fault of a reason is logged at once, later ones at most
once per LOG_INTERVAL_S for that reason; a line after suppressed ones says how many were counted, not
logged, since the last. So a fault that recurs is seen again (a second truncated file an hour later, the
missing files after the namespace directory was deleted), and a disk failing every read logs a line a
minute per reason, not one per read. Each line names the file (or key) the fault concerns.

This is NOT what the store does about a fault (store.py: drop, delete or set aside the file). The clock is
`monotonic`, looked up here at each call (tests replace it to step past the interval).
"""

from __future__ import annotations

import logging
import threading
from time import monotonic

LOG_INTERVAL_S = 60.0  # least time between two lines of one reason


class FaultLog:
    """Counts faults by reason and logs them, each reason at most once per LOG_INTERVAL_S. Thread-safe."""

    def __init__(self, prefix: str, logger: logging.Logger):
        self.prefix, self.logger = prefix, logger  # prefix: names the namespace at the start of every line
        self.counts: dict[str, int] = {}  # reason -> occurrences, logged or not
        self._logged_s: dict[str, float] = {}  # reason -> monotonic time of its last line
        self._unlogged: dict[str, int] = {}  # reason -> occurrences counted since its last line, not logged
        self._lock = threading.Lock()  # guards the three above

    def count(self, reason: str) -> None:
        """Count a fault without a line: one that another line already stands for (a read-only store's
        refused put: its start-up warning says why every put is refused)."""
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1

    def report(self, reason: str, subject: str, detail: str = "") -> None:
        """Count a fault about `subject` (the file or key it concerns) and log it as a WARNING, unless a line
        of `reason` was logged less than LOG_INTERVAL_S ago (then it is counted for the next line)."""
        now_s = monotonic()
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
            last_s = self._logged_s.get(reason)
            if last_s is not None and now_s - last_s < LOG_INTERVAL_S:
                self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
                return
            self._logged_s[reason] = now_s
            num_unlogged = self._unlogged.pop(reason, 0)
        if last_s is None:
            tail = f"; more {reason} within {LOG_INTERVAL_S:.0f} s are counted, not logged"
        elif num_unlogged:
            tail = (f"; and {num_unlogged} more {reason} since the last line {now_s - last_s:.0f} s ago "
                    "(counted, not logged)")
        else:
            tail = ""
        self.logger.warning("%s: %s: %s%s%s", self.prefix, reason, subject, f" ({detail})" if detail else "", tail)
