"""ProcessWorkers: a few spawned worker processes for the heavy part of accepting a request, each
running one job at a time, so that its CPU time and its big objects stay out of the server process
(whose interpreter lock the engine thread and the event loop share).

    workers = ProcessWorkers(num_processes, context)   # context: picklable, handed to every job
    result = await workers.run(fn, chunks, *args)       # fn(context, b"".join(chunks), *args), in a worker;
                                                        #   empties `chunks`

What crosses the process boundary, and what it costs the server process:
- `chunks` (a request body as it arrived): each written to the worker's pipe as it is, never joined
  or copied here (the write releases the interpreter lock), and dropped from the list once written,
  first to last, so that its memory is freed piece by piece: freeing megabytes at once (a list's
  last chunk first, as `del` does) holds the lock for tens of milliseconds while the heap shrinks;
- `fn` and `args`, the result, or the exception the job raised: pickled, so keep them small.

A worker that dies (killed, crashed) fails only the job it was running (WorkerDied) and is replaced;
the other workers keep theirs. Workers run at a lower CPU priority (`nice`) so that, on a busy
machine, the engine thread gets a core before them. What this is not: a general executor (a
running job is never cancelled; no timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)
WORKER_NICE = 10  # added to the workers' nice value: the engine thread comes first
WORKER_EXIT_S = 1.0  # how long a closed worker has to end by itself (its exit handlers run) before it is killed


class WorkerDied(RuntimeError):
    """The worker process running the job ended before answering (killed, out of memory, crashed)."""


class WorkerGone(WorkerDied):
    """The worker was gone before the job reached it (its end of the pipe closed): the job never ran."""


class WorkersClosed(RuntimeError):
    """The pool was closed (the server is shutting down)."""


def _worker_main(conn: Connection, context: Any, nice: int) -> None:
    """A worker's loop: (fn, args, number of chunks), then the chunks; answers ("ok", result) or ("error", e)."""
    with contextlib.suppress(OSError):
        os.nice(nice)
    while True:
        try:
            fn, args, num_chunks = conn.recv()
            data = b"".join([conn.recv_bytes() for _ in range(num_chunks)])
        except (EOFError, OSError):  # the server closed the pipe: it is stopping
            return
        try:
            answer = ("ok", fn(context, data, *args))
        except Exception as e:
            answer = ("error", e)
        del data
        try:
            conn.send(answer)
        except Exception as e:  # a result or an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]} (not picklable: {e})")))


class _Worker:
    """One worker process and the pipe to it; used by one thread at a time."""

    def __init__(self, mp: Any, context: Any):
        self.conn, child = mp.Pipe()
        self.process = mp.Process(target=_worker_main, args=(child, context, WORKER_NICE), daemon=True,
                                  name="cairn-request-worker")
        self.process.start()
        child.close()  # else the pipe would stay open when the worker dies, and recv() would never end

    def run(self, fn: Callable, chunks: list[bytes], args: tuple) -> Any:
        """fn(context, b"".join(chunks), *args) in the worker; empties `chunks` as it sends them."""
        try:
            self.conn.send((fn, args, len(chunks)))
        except OSError as e:  # nothing was delivered (and `chunks` is untouched): it could be run elsewhere
            self.process.join(1.0)
            raise WorkerGone(f"the request worker process was gone (exit code {self.process.exitcode})") from e
        try:
            while chunks:
                self.conn.send_bytes(chunks.pop(0))
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            self.process.join(1.0)
            raise WorkerDied(f"the request worker process died (exit code {self.process.exitcode})") from e
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        """Close the pipe: an idle worker's loop sees it closed and the process exits by itself (its exit
        handlers run); one that has not ended within WORKER_EXIT_S (stuck, or a job still running) is killed."""
        self.conn.close()
        self.process.join(WORKER_EXIT_S)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(1.0)


async def in_thread(threads: ThreadPoolExecutor, fn: Callable, *args) -> Any:
    """fn(*args) on one of `threads`: its result; WorkersClosed once the pool has been shut down (it refuses
    new work)."""
    try:
        job = asyncio.get_running_loop().run_in_executor(threads, fn, *args)
    except RuntimeError:
        raise WorkersClosed("cannot schedule new jobs after shutdown") from None
    return await job


class ProcessWorkers:
    """`num_processes` workers; jobs beyond that wait for a free one. Methods may be called from any thread."""

    def __init__(self, num_processes: int, context: Any):
        self.num_processes = num_processes
        self._context = context
        self._mp = multiprocessing.get_context("spawn")  # no copy of the server's threads and memory
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._started = False
        self._closed = False
        self._threads = ThreadPoolExecutor(num_processes, thread_name_prefix="cairn-request-worker")

    def start(self) -> None:
        """Spawn the workers now (they import the server's modules: seconds) rather than on first use."""
        if not self._started:
            self._started = True
            for _ in range(self.num_processes):
                self._idle.put(_Worker(self._mp, self._context))

    async def run(self, fn: Callable, chunks: list[bytes], *args) -> Any:
        """fn(context, b"".join(chunks), *args) in a worker process: its result, or the exception it
        raised; WorkerDied if the worker died meanwhile; WorkersClosed once closed. `chunks` is emptied
        (see above): pass a list nothing else holds the chunks of."""
        return await in_thread(self._threads, self._run, fn, chunks, args)  # (close() shuts the pool down first)

    def _run(self, fn: Callable, chunks: list[bytes], args: tuple) -> Any:
        self.start()
        worker = self._idle.get()
        if not worker.process.is_alive():  # it died while idle (killed): this job need not fail
            worker = self._replace_idle(worker)
        try:
            try:
                return worker.run(fn, chunks, args)
            except WorkerGone:  # it died idle but still looked alive (killed a moment ago): the job never ran
                worker = self._replace_idle(worker)
                return worker.run(fn, chunks, args)
        except WorkerDied:
            worker.close()
            if self._closed:
                raise
            log.error("a request worker process died (exit code %s); starting another", worker.process.exitcode)
            worker = _Worker(self._mp, self._context)
            raise
        finally:
            if self._closed:
                worker.close()
            else:
                self._idle.put(worker)

    def _replace_idle(self, worker: _Worker) -> _Worker:
        log.warning("a request worker process died while idle (exit code %s); starting another",
                    worker.process.exitcode)
        worker.close()
        return _Worker(self._mp, self._context)

    def close(self) -> None:
        """Stop the workers; a job running now still ends, later ones raise WorkersClosed."""
        self._threads.shutdown(wait=False, cancel_futures=True)  # from now on, run() refuses
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return
