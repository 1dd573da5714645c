"""RemoteLookups: what the remote tier holds for a prompt, asked off the engine thread and kept for admission.

A lookup is one Redis round trip (up to the client's timeout when Redis is slow, before the breaker opens).
Made at admission on the engine thread, it would stall every running stream that long; so it runs on a
small pool of lookup threads, and admission only reads the answer:

    start(token_ids, message_starts, salt_key)  any thread: queue the lookup of this prompt (nothing when one
                     for the same tokens and salt key is queued, running or answered less than ANSWER_TTL_S
                     ago); returns a concurrent Future, done when the answer is in (the server awaits it
                     before the request reaches the engine queue, so admission finds it there)
    answer(token_ids, salt_key)  any thread (the engine's, at admission): the found segments (a list, [] on a miss or
                     while Redis is down) when the lookup is done, PENDING while it runs, None when none was
                     started (or its answer expired); deepest_snapshot(token_ids) reads it for a probe

The answer of a lookup is kept ANSWER_TTL_S (an old answer may miss segments written since) and at most
MAX_ANSWERS prompts are remembered (the oldest are forgotten first). While MAX_IN_FLIGHT lookups are
running, a new one is not queued: it answers [] at once (counted as "lookups_refused"). An answer is kept under
the prompt and its salt key together: the same prompt under another cache salt is another lookup.

What this is not: the lookup itself (finder.py's lookup) or what the cache does with an answer (DiskIndex).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from cairn.cache.segments.segment import _tokens_to_bytes

log = logging.getLogger(__name__)

PENDING = object()  # answer(): the lookup is still running
ANSWER_TTL_S = 5.0  # an answer older than this is not used (segments written since would be missed)
MAX_ANSWERS = 256  # prompts whose answer (or lookup in flight) is remembered
MAX_IN_FLIGHT = 64  # lookups queued or running; one more answers [] at once
NUM_THREADS = 2


def prompt_digest(token_ids: Sequence[int], salt_key: bytes | None = None) -> bytes:
    return hashlib.blake2b(_tokens_to_bytes(token_ids), digest_size=16, key=salt_key or b"").digest()


class RemoteLookups:
    def __init__(self, find: Callable[[Sequence[int], Sequence[int], bytes | None], list], ttl_s: float = ANSWER_TTL_S,
                 max_answers: int = MAX_ANSWERS, max_in_flight: int = MAX_IN_FLIGHT):
        self._find = find  # finder.lookup over one tier: (token_ids, message_starts, salt_key) -> found segments
        self.ttl_s, self.max_answers, self.max_in_flight = ttl_s, max_answers, max_in_flight
        self.counters: Counter[str] = Counter()  # lookups_started, lookups_refused, answers_expired
        self._answers: OrderedDict[bytes, tuple[float, Future]] = OrderedDict()  # digest -> (started, future)
        self._num_in_flight = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="cairn-remote-lookup")

    def start(self, token_ids: Sequence[int], message_starts: Sequence[int] = (), salt_key: bytes | None = None
              ) -> Future:
        digest, now = prompt_digest(token_ids, salt_key), time.monotonic()
        with self._lock:
            known = self._answers.get(digest)
            if known is not None and (not known[1].done() or now - known[0] < self.ttl_s):
                return known[1]
            future: Future = Future()
            if self._num_in_flight >= self.max_in_flight:
                self.counters["lookups_refused"] += 1
                future.set_result([])
                return future
            self._num_in_flight += 1
            self.counters["lookups_started"] += 1
            self._answers[digest] = (now, future)
            self._answers.move_to_end(digest)
            while len(self._answers) > self.max_answers:
                self._answers.popitem(last=False)
                self.counters["answers_expired"] += 1
        self._pool.submit(self._run, future, list(token_ids), list(message_starts), salt_key)
        return future

    def _run(self, future: Future, token_ids: list[int], message_starts: list[int], salt_key: bytes | None) -> None:
        try:
            found = self._find(token_ids, message_starts, salt_key)
        except Exception:  # a bug, not Redis (the store turns Redis errors into misses): a miss all the same
            log.exception("remote lookup failed")
            found = []
        finally:
            with self._lock:
                self._num_in_flight -= 1
        _settle(future, found)

    def answer(self, token_ids: Sequence[int], salt_key: bytes | None = None):
        """The found segments, PENDING, or None (see the module docstring)."""
        with self._lock:
            known = self._answers.get(prompt_digest(token_ids, salt_key))
        if known is None:
            return None
        started, future = known
        if not future.done():
            return PENDING
        return future.result() if time.monotonic() - started < self.ttl_s else None

    def deepest_snapshot(self, token_ids: Sequence[int], salt_key: bytes | None = None) -> int:
        """The end of the deepest found segment holding a snapshot, in the answer for this prompt (0: none,
        or no answer yet)."""
        found = self.answer(token_ids, salt_key)
        if found is None or found is PENDING:
            return 0
        return max([0, *(len(path) for path, _, _, has_snapshot, *_ in found if has_snapshot)])

    def close(self) -> None:
        """Stop the lookup threads; every lookup not done answers [] (nobody waits on one for ever)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            futures = [future for _, future in self._answers.values()]
        for future in futures:
            _settle(future, [])


def _settle(future: Future, found: list) -> None:
    with contextlib.suppress(InvalidStateError):  # already settled by close()
        future.set_result(found)
