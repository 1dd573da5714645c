"""WriteBehind: one background thread running writes from a bounded queue, off the request's path.

    submit(job)    True when queued; False when the queue is full (the caller counts the drop)
    flush(t)       wait up to t seconds until every queued job has run
    close(t)       run what is queued (up to t seconds), then stop the thread (its owner's close calls it once)

A job that raises is logged and handed to `on_error`; the thread keeps going.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class WriteBehind:
    def __init__(self, run: Callable[[Any], None], on_error: Callable[[Any], None], capacity: int, name: str):
        self._run, self._on_error = run, on_error
        self._queue: queue.Queue = queue.Queue(capacity)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job) -> bool:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            return False
        return True

    @property
    def num_queued(self) -> int:
        return self._queue.unfinished_tasks

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._run(job)
            except Exception:
                log.exception("%s: a background write failed", self._thread.name)
                self._on_error(job)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
