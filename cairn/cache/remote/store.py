"""RedisSegmentStore: disk-format segments in a shared Redis, a SegmentStore (cairn/cache/segments/store.py).

    put(segment)     queue the write (True) or refuse it (False, counted): breaker open, queue full, or a
                     parent this process does not know (a chain must be written parents first)
    get(key)         the fully verified segment, or None: unknown key, Redis down (breaker), a value that
                     vanished (TTL, maxmemory eviction: a miss), or a bad value (checksum, version,
                     namespace...: counted by reason in `faults` and deleted from Redis). Never wrong data.
    lookup(tokens, positions)   one pipelined round trip probing the index entries (and markers) at those
                     prefix positions of a prompt (see keys.py); the deepest chain ending in a snapshot is
                     registered here and returned, parents first. When another replica's marker says a
                     deeper chain is being written, the probe is repeated every WAIT_POLL_S until it has
                     landed (or the marker is gone, or wait_s has passed): the turn that follows a turn
                     served elsewhere arrives before that turn's write-behind is done
    info / keys / get_tokens / pin / unpin / len / close    as the protocol's, over the segments this
                     process knows of (those it wrote or looked up): Redis may hold more, or fewer (it
                     evicts and expires without telling anyone)
    used_bytes       the bytes of the known segments (as stored in Redis; a queued one's uncompressed
                     size until written; 0 for one a lookup found without its size): what this replica
                     believes Redis holds for it, at most `byte_budget`, NOT what Redis holds (its INFO
                     memory says that, for every replica and key together)

The record of known segments (record.py) is bounded twice, the least recently used forgotten first (on_evict
is told; Redis keeps them, a later lookup finds them again; counted in stats()["forgotten"]): by count
(max_segments) and by bytes (`byte_budget`: Redis's maxmemory, read with CONFIG GET, or from INFO memory where a managed
Redis refuses CONFIG, again every MEMORY_READ_INTERVAL_S; or the max_bytes given, the smaller of the two).
Redis cannot hold more than its maxmemory, so a record that claims more claims segments Redis has evicted,
which this replica would then neither write again nor know to be gone. It is a loose bound (other replicas'
segments, the index entries and Redis's own overhead share that memory), but one the record never passes. A
Redis without a maxmemory (0), or one that answers neither, bounds nothing (max_bytes alone does, when given).

Writes happen behind the request: `put` only records the segment here and queues it; a background
thread encodes it (segment.py, every section checksummed) and sends it with its index entries in one
pipeline; a segment with a snapshot is first announced by markers (keys.py), set by a thread of their
own so that they never wait behind the queued writes. A segment is readable here from the moment `put`
returns (from memory until written). A
write that fails leaves the index (counted, and `on_evict` is told). Redis has no pins: `pin` only
keeps this process's record; a segment Redis evicted anyway is a miss.

Eviction under a maxmemory policy (allkeys-lru, the recommended one) ranks keys by their last use, and a
conversation grows by new children while its parents are only read by a replica that does not hold them: so
every write pipeline also touches the known segments the written one chains below (TOUCH, or EXPIRE with a
TTL), before setting it: a chain's parents are never less recently used than its newest segment, and Redis
evicts whole old conversations rather than the roots of live ones. A value found vanished all the same (get:
"missing") is forgotten here with every known segment chained below it (they cannot be resumed without it,
and may be gone too), telling on_evict: the next request over that path, which recomputes it, writes it
whole from there, as after a `redis_reset` below, for one chain.

A replica writes only the segments of a path it does not know to be in Redis, so every write and lookup
pipeline also reads the namespace's epoch key, and when Redis lost what was written before (restarted empty,
flushed: epoch.py tells that from an epoch key evicted alone), every segment known here is forgotten (on_evict
is told, counted as the fault `redis_reset`, one log line): the next request over each path writes it whole.

The lookup side (lookup, and registering what it found) is chains.py's ChainLookup, mixed in here.
A SegmentStore (segments/store.py) that is `shared` and `write_behind`; the tier over it is the disk's
(segments/tier.py, SegmentTier: the factory builds it with the name REMOTE), and it has no remove_unreachable
(nothing is an orphan in a store other replicas write). What this is not: the tier's choice of what to write or
when to look up (segments/tier.py, finder.py), the segment format.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

from cairn.cache.remote.chains import ChainLookup
from cairn.cache.remote.client import DEFAULT_COOLDOWN_S, DEFAULT_TIMEOUT_S, FAILED, GuardedRedis, maxmemory, split_url
from cairn.cache.remote.epoch import Epoch
from cairn.cache.remote.keys import IndexEntry, KeyNames, index_entries
from cairn.cache.remote.markers import Markers
from cairn.cache.remote.record import KnownSegment, KnownSegments
from cairn.cache.remote.writer import WriteBehind
from cairn.cache.segments.decode import decode_segment
from cairn.cache.segments.pins import Pins
from cairn.cache.segments.segment import (
    DEFAULT_LIMITS,
    Segment,
    SegmentError,
    SegmentLimits,
    encode_segment,
)
from cairn.cache.segments.store import SegmentInfo

log = logging.getLogger(__name__)
DEFAULT_QUEUE_SEGMENTS = 64  # writes waiting for the background thread; one more is dropped (counted)
DEFAULT_MAX_SEGMENTS = 1 << 16  # segments known here (written or looked up); the least recently used go first
DEFAULT_WAIT_S = 3.0  # the longest a lookup waits for a deeper chain another replica's marker announces
MEMORY_READ_INTERVAL_S = 60.0  # Redis's maxmemory is read again this often (CONFIG SET changes it at run time)


@dataclasses.dataclass(frozen=True)
class _Write:
    segment: Segment
    entries: tuple[tuple[bytes, IndexEntry], ...]  # (canonical key of the entry's position, entry sans size)
    parents: tuple[bytes, ...] = ()  # keys of the known segments it chains below, touched with its write


class RedisSegmentStore(ChainLookup, Pins):
    readonly = False  # every replica writes: Redis arbitrates, there is no lock
    shared = True  # other replicas write it too: it may hold what this process never wrote
    write_behind = True  # put only queues the write; counted("written") is how many landed

    def __init__(self, url: str, namespace: str, page_size: int, *, compression: str | None = None,
                 limits: SegmentLimits = DEFAULT_LIMITS, on_evict: Callable[[bytes], None] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cooldown_s: float = DEFAULT_COOLDOWN_S,
                 queue_segments: int = DEFAULT_QUEUE_SEGMENTS, ttl_s: int | None = None, client=None,
                 max_segments: int = DEFAULT_MAX_SEGMENTS, wait_s: float = DEFAULT_WAIT_S,
                 max_bytes: int | None = None):
        self.url, self.compat_digest, self.page_size = url, namespace, page_size
        self.compression, self.limits, self.on_evict, self.ttl_s = compression, limits, on_evict, ttl_s
        self.names = KeyNames(namespace)
        self.max_segments = max_segments  # cap on the segments known here (Redis may hold many more)
        self.max_bytes = max_bytes  # cap on their bytes, beside Redis's maxmemory (None: that alone)
        self.redis_maxmemory: int | None = None  # as Redis last told it (0: no limit; None: not told)
        self._memory_read_at: float | None = None  # time.monotonic() of the last attempt to read it
        self.wait_s = wait_s  # see DEFAULT_WAIT_S; 0: never wait for another replica's write
        self.writer_id = os.urandom(8).hex()  # names this store's markers (its own are not waited for)
        self.faults: dict[str, int] = {}  # reason -> occurrences
        split_url(url)  # ValueError now for a URL of another scheme, not silent faults on the first call
        self.redis = GuardedRedis(url, timeout_s, cooldown_s, self._fault, client)
        self.epoch = Epoch(self.redis, self.names, self._fault)  # tells when Redis lost what was written before
        self._counts = {"puts": 0, "gets": 0, "hits": 0, "written": 0, "lookups": 0, "found": 0, "forgotten": 0,
                        "lookups_waited": 0, "lookup_waits_expired": 0}
        self._index = KnownSegments()  # the segments known here (written or looked up), least recently used first
        self._pending: dict[bytes, Segment] = {}  # queued, not yet written
        self._pins: dict[bytes, int] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._writer = WriteBehind(self._write, self._write_failed, queue_segments, "cairn-remote-writer")
        self.markers = Markers(self.redis, self.names, self.writer_id, queue_segments, self._fault)

    def _fault(self, reason: str) -> None:
        with self._lock:
            self.faults[reason] = self.faults.get(reason, 0) + 1

    # ---- writes ---------------------------------------------------------------------------------

    def put(self, segment: Segment) -> bool:
        """Record segment here and queue its write; False (counted) when it cannot be written."""
        with self._lock:
            assert not self._closed, "the engine closes the cache once, at shutdown, and calls it no more"
            known = self._index.get(segment.key)
            if known is not None and _covers(known.info, segment):
                self._index.touch(segment.key)
                return True
            chain = self._index.chain_of(segment)
            if chain is None:
                self._fault("unknown_parent")
                return False
            bounds, start_hash, end_hash = chain
            entries = index_entries(segment, bounds, start_hash, end_hash, self.page_size)
            parents = self._index.ancestors(segment.parent_key)
            for key in reversed(parents):  # used now, as in Redis once written (the module docstring)
                self._index.touch(key)
        if self.redis.breaker.is_open:
            self._fault("breaker_open")
            return False
        info = SegmentInfo(segment.key, segment.parent_key, segment.start_position, len(segment.tokens),
                           segment.snapshot_bytes is not None, segment.logits_bytes is not None,
                           _raw_bytes(segment), time.time())
        with self._lock:  # before the writer can finish (or fail) it: its end then finds it here
            self._pending[segment.key] = segment
            self._index.add(KnownSegment(info, bounds, segment.tokens, end_hash))
        # announced before the write is queued: the writer deletes the markers after flushing their thread,
        # so one set after that would outlive the write (readers would wait for nothing); refused when full:
        # readers then do not wait, nothing else is lost
        announced = segment.snapshot_bytes is not None and self.markers.announce(entries)
        if not self._writer.submit(_Write(segment, entries, parents)):
            self._fault("queue_full")
            with self._lock:
                self._pending.pop(segment.key, None)
                self._index.restore(segment.key, known)
            if announced:
                self.markers.withdraw(entries)
            return False
        with self._lock:
            self._counts["puts"] += 1
        self._trim(keep={segment.key})
        return True

    def _write_failed(self, job: _Write) -> None:
        self._fault("write_failed")
        self._drop([job.segment.key])

    def _write(self, job: _Write) -> None:
        try:
            value = encode_segment(job.segment, self.compat_digest, self.compression, self.limits)
        except SegmentError:
            self._fault("too_large")
            self._drop([job.segment.key])
            self.markers.flush(self.redis.timeout_s)
            self.redis.pipelined(self.markers.unmark(job.entries))  # nobody waits for a write that will not come
            return
        sets = [(self.names.segment(job.segment.key), value)]
        for end_key, entry in job.entries:  # after the segment: an entry never leads to nothing
            sized = IndexEntry(entry.key, entry.bounds, entry.tail, entry.has_snapshot, entry.has_logits, len(value))
            sets.append((self.names.entry(end_key), sized.encode()))
        unmark = []
        if job.segment.snapshot_bytes is not None:  # its markers are deleted with it, so set before it
            self.markers.flush(self.redis.timeout_s)
            unmark = self.markers.unmark(job.entries)
        epoch = self.epoch.probe(write=True)
        touch = [("touch", self.names.segment(key)) for key in job.parents]  # before the sets: see the docstring
        result = self.redis.pipelined(epoch + touch + [("set", name, data) for name, data in sets] + unmark,
                                      self.ttl_s)
        if result is FAILED:
            self._drop([job.segment.key])
            return
        with self._lock:
            self._pending.pop(job.segment.key, None)
            self._counts["written"] += 1
            self._index.resize(job.segment.key, len(value))
        self.saw_epoch(result[len(epoch) - 1], job.segment.key)  # after the write: one whose parents Redis lost is
        # forgotten too
        self._trim(keep={job.segment.key})  # its size is now the stored one (with compression's framing)
        self.read_maxmemory(keep={job.segment.key})

    def saw_epoch(self, value: bytes | None, written: bytes | None = None) -> None:
        """The epoch key read by a pipeline: when it shows Redis lost what was written before (epoch.py), forget
        every segment known here but a pinned one (its load finds it missing). `written`: the segment the calling
        pipeline wrote, which proves nothing. (Another replica may have written that same segment again since a
        flush: then the segments lost here are found gone when read, and forgotten with what chains below them,
        chain by chain.)"""
        if not self.epoch.saw(value, lambda n: self._witnesses(n, written)):
            return
        with self._lock:
            keys = [k for k in self._index if k not in self._pins]
            self._memory_read_at = None  # a Redis restarted may have another maxmemory
        self._fault("redis_reset")
        log.warning("remote cache %s lost what was written before (its epoch key changed: restarted empty or "
                    "flushed); forgetting the %d segments known here, which the next requests write again",
                    self.redis.breaker.name, len(keys))
        self._drop(keys)

    def _witnesses(self, n: int, written: bytes | None) -> list[bytes]:
        """The n most recently used known segments that may show Redis still holds what was written (not one
        queued, nor `written`)."""
        with self._lock:
            return self._index.most_recent(n, lambda k: k in self._pending or k == written)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write is done; False if some are still queued after timeout_s."""
        return self._writer.flush(timeout_s)

    # ---- reads ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> Segment | None:
        """The verified segment stored under key, or None (see the module docstring)."""
        got = self.read(key)
        return got if isinstance(got, Segment) else None

    def read(self, key: bytes) -> Segment | str:
        """get's segment, or why there is none: "evicted" (not known here, or Redis no longer has the value),
        "corrupt" (the value failed verification: deleted) or "unavailable" (Redis did not answer: the segment
        stays known, and is read again once Redis answers)."""
        with self._lock:
            self._counts["gets"] += 1
            if key in self._pending:
                self._counts["hits"] += 1
                return self._pending[key]
            if key not in self._index:
                return "evicted"
        value = self.redis.call(lambda c: c.get(self.names.segment(key)))
        if value is FAILED:
            return "unavailable"
        if value is None:  # expired or evicted by Redis: a miss, and what chains below it is forgotten too
            self._fault("missing")
            with self._lock:
                below = self._index.below(key)
            self._drop(below)
            return "evicted"
        try:
            segment = decode_segment(value, self.compat_digest, self.limits)
            if segment.key != key:
                raise SegmentError("malformed", "the value is another segment")
        except SegmentError as e:
            self.redis.call(lambda c: c.delete(self.names.segment(key)))
            self._reject(key, e.reason)
            return "corrupt"
        with self._lock:
            self._counts["hits"] += 1
            self._index.touch(key)
        return segment

    def get_tokens(self, key: bytes) -> tuple[int, ...] | None:
        """The tokens of a known segment (verified against its key when it was written or looked up)."""
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.tokens

    def _trim(self, keep: set[bytes]) -> None:
        """Forget the least recently used known segments beyond max_segments or byte_budget (never one queued
        for writing, pinned, or in `keep`: the chain just written or found; those alone may exceed either),
        telling on_evict: the cache then drops the tree's references to them, so neither this index nor the
        nodes whose only copy is in Redis grow without bound, nor claim more than Redis can hold. Counted in
        stats()["forgotten"]."""
        with self._lock:
            keys = self._index.least_recent(self.max_segments, self.byte_budget,
                                            lambda k: k in self._pending or k in self._pins or k in keep)
            self._counts["forgotten"] += len(keys)
        self._drop(keys)

    @property
    def byte_budget(self) -> int | None:
        """The bytes the known segments may claim: the smaller of max_bytes and Redis's maxmemory (None: no bound;
        the module docstring)."""
        bounds = [b for b in (self.max_bytes, self.redis_maxmemory or None) if b is not None]
        return min(bounds) if bounds else None

    @property
    def effective_budget_bytes(self) -> int | None:
        """The bound evictions of the record fit (byte_budget), under the name DiskStore's reports use."""
        return self.byte_budget

    def read_maxmemory(self, keep: set[bytes]) -> None:
        """Ask Redis its maxmemory if MEMORY_READ_INTERVAL_S have passed since the last attempt, and trim the record
        to it. The writer and lookup threads call it (never the engine's), after a pipeline Redis answered."""
        with self._lock:
            now = time.monotonic()
            if self._memory_read_at is not None and now - self._memory_read_at < MEMORY_READ_INTERVAL_S:
                return
            self._memory_read_at = now
        value = self.redis.call(maxmemory)
        if value is FAILED or value is None:  # not reached (counted by the client), or it would not say
            return
        with self._lock:
            self.redis_maxmemory = value
        self._trim(keep)

    def _reject(self, key: bytes, reason: str) -> None:
        self._fault(reason)
        self._drop([key])

    def _drop(self, keys: list[bytes]) -> None:
        """Forget keys here and tell on_evict (outside the lock)."""
        dropped = []
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)
                if self._index.remove(key):
                    dropped.append(key)
        if self.on_evict is not None:
            for key in dropped:
                self.on_evict(key)

    # ---- the index, as DiskStore's ----------------------------------------------------------------

    def info(self, key: bytes) -> SegmentInfo | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.info

    def keys(self) -> list[bytes]:
        """Known keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Bytes of the known segments, at most byte_budget (not what Redis holds: the module docstring)."""
        return self._index.num_bytes

    def stats(self) -> dict:
        with self._lock:
            return {"segments": len(self._index), "used_bytes": self._index.num_bytes,
                    "byte_budget": self.byte_budget or 0, "redis_maxmemory": self.redis_maxmemory or 0,
                    "queued": self._writer.num_queued, **self._counts, "marked": self.markers.num_set,
                    "breaker_opened": self.redis.breaker.num_opened}

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()
            assert all(n > 0 for n in self._pins.values()), "non-positive pin count"
            assert set(self._pending) <= set(self._index), "a queued segment is not indexed"

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the queued writes (up to timeout_s), stop the writer and close the connection. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writer.close(timeout_s)
        self.markers.close(timeout_s)
        self.redis.close()


def _covers(info: SegmentInfo, segment: Segment) -> bool:
    return (info.has_snapshot or segment.snapshot_bytes is None) and (info.has_logits or segment.logits_bytes is None)


def _raw_bytes(segment: Segment) -> int:
    return sum(len(b) for b in (segment.kv_bytes, segment.snapshot_bytes or b"", segment.logits_bytes or b"")) \
        + 4 * len(segment.tokens)
