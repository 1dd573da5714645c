"""Epoch: how a RedisSegmentStore notices that Redis lost what was written before (restarted empty, flushed).

A replica writes only the segments of a path it does not know to be in Redis, so a Redis restarted empty (or
flushed) under a running replica would be sent only the new ends of its conversations, chains whose parents
are gone, which nobody can resume. So every write and lookup pipeline also reads the namespace's epoch key
(keys.py; set to a random value by the first replica to find it absent, `probe`): when it differs from the one
read last here, Redis lost what was written before (`saw` says so: the store then forgets every segment it
knows, counted as the fault `redis_reset`, and the next request over each path writes it whole). Unless a
recently used segment known here (a witness) is still in Redis: then Redis evicted the epoch key alone
(allkeys-lru ranks keys by the second they were last used: under a write rate that fills maxmemory within
seconds, the epoch key, read by every pipeline, is no safer than any other key), counted as the fault
`epoch_evicted`, and nothing is forgotten.

What this is not: the forgetting (the store's), the pipelines (the store's writer and chains.py's lookup),
or the Redis client (client.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from cairn.cache.remote.client import FAILED, GuardedRedis
from cairn.cache.remote.keys import KeyNames

WITNESSES = 4  # recent segments whose presence shows an epoch key gone was evicted, not flushed


class Epoch:
    def __init__(self, redis: GuardedRedis, names: KeyNames, fault: Callable[[str], None]):
        self.redis, self.names, self._fault = redis, names, fault
        self._value: bytes | None = None  # the epoch key as last read (None: not read yet)
        self._lock = threading.Lock()  # the writer and lookup threads both read it

    def probe(self, write: bool = False) -> list[tuple]:
        """The commands, first in a pipeline, that read the namespace's epoch key (a write's pipeline sets it
        first to a new random value where Redis has none; a lookup only reads, so that a Redis refusing writes
        at its maxmemory still answers it); the pipeline's result at len(...) - 1 is its value, for `saw`."""
        name = self.names.epoch()
        return [("setnx", name, os.urandom(8).hex().encode()), ("get", name)] if write else [("get", name)]

    def saw(self, value: bytes | None, witnesses: Callable[[int], list[bytes]]) -> bool:
        """The epoch key read by a pipeline: True when Redis lost what was written before, that is when it changed
        (or is gone) since the last one read here and none of the segments witnesses(WITNESSES) names (the most
        recently used known here, except what proves nothing: the segment the calling pipeline wrote, one still
        queued) is in Redis; then the caller forgets what it knows. False otherwise (counted as the fault
        "epoch_evicted" when the key changed but a witness is still there). witnesses is called only when the key
        changed; when Redis does not answer, forgetting is the safe side."""
        with self._lock:
            before, self._value = self._value, value
        if before is None or value == before:
            return False
        recent = witnesses(WITNESSES)
        if recent and self._any_held(recent):
            self._fault("epoch_evicted")
            return False
        return True

    def _any_held(self, keys: list[bytes]) -> bool:
        """One of these segments is in Redis (False when Redis does not answer)."""
        result = self.redis.pipelined([("exists", self.names.segment(key)) for key in keys])
        return result is not FAILED and any(result)
