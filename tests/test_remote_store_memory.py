"""The Redis segment store against a real redis-server that evicts: what a replica believes Redis holds stays
within what Redis can hold (its maxmemory, read with CONFIG GET, or INFO where CONFIG is refused), and an epoch
key evicted is not taken for a Redis flushed.

Each test starts its own redis-server (tests/redis_server.py), skipped only when none is installed; the segments
are test_remote_store.py's.
"""

from __future__ import annotations

from cairn.cache.disk.segment import Segment
from tests.redis_server import redis_or_skip
from tests.test_remote_store import chain, make_store, put_all

MAXMEMORY = 3 << 20
VALUE_BYTES = 512 << 10  # each segment's KV: a dozen of them is twice MAXMEMORY


def big_segment(first_token: int) -> Segment:
    """A one-segment chain of 4 tokens with VALUE_BYTES of KV and a snapshot."""
    (seg,) = chain(list(range(first_token, first_token + 4)), [0, 4], snapshot_at={4})
    return Segment(seg.key, None, 0, seg.tokens, kv_bytes=bytes([first_token % 251]) * VALUE_BYTES,
                   snapshot_bytes=seg.snapshot_bytes, logits_bytes=seg.logits_bytes, snapshot_meta=seg.snapshot_meta)


def written_past_maxmemory(*redis_args: str):
    """(redis, store) after a dozen segments of VALUE_BYTES were written on a Redis of MAXMEMORY under allkeys-lru."""
    redis = redis_or_skip("--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "allkeys-lru", *redis_args)
    forgotten: list[bytes] = []
    store = make_store(redis.url, on_evict=forgotten.append)
    for i in range(12):
        put_all(store, [big_segment(10 * i)])
    return redis, store, forgotten


def test_the_known_segments_never_claim_more_bytes_than_redis_maxmemory():
    """The record was bounded by count alone: it went on claiming the 6 MiB written while Redis held at most 3."""
    redis, store, forgotten = written_past_maxmemory()
    try:
        stats = store.stats()
        assert stats["redis_maxmemory"] == MAXMEMORY and stats["byte_budget"] == MAXMEMORY
        assert 0 < store.used_bytes <= MAXMEMORY and stats["used_bytes"] == store.used_bytes
        assert len(forgotten) >= 6 and stats["forgotten"] == len(forgotten)  # least recently used first:
        assert forgotten == [big_segment(10 * i).key for i in range(len(forgotten))]  # the oldest
        store.check_integrity()  # used_bytes is the sum of the known sizes
        # Redis evicted its epoch key too (every key here was used within the same second, LRU's resolution); the
        # segments it still holds show it was not flushed: nothing else is forgotten
        assert set(store.faults) <= {"epoch_evicted"}
    finally:
        store.close(), redis.stop()


def test_a_redis_that_refuses_config_still_bounds_the_record_by_info_memory():
    """Managed Redis services refuse CONFIG: the maxmemory INFO memory reports bounds the record all the same."""
    redis, store, forgotten = written_past_maxmemory("--rename-command", "CONFIG", "")
    try:
        assert store.stats()["byte_budget"] == MAXMEMORY and store.used_bytes <= MAXMEMORY and forgotten
        assert set(store.faults) <= {"epoch_evicted"}  # a refused CONFIG is no fault (see the next test)
    finally:
        store.close(), redis.stop()


def test_a_redis_that_tells_no_maxmemory_bounds_nothing_and_counts_no_fault():
    redis, store, forgotten = written_past_maxmemory("--rename-command", "CONFIG", "", "--rename-command", "INFO", "")
    try:
        stats = store.stats()
        assert stats["redis_maxmemory"] == 0 and stats["byte_budget"] == 0 and forgotten == []
        assert set(store.faults) <= {"epoch_evicted"} and len(store) == 12
    finally:
        store.close(), redis.stop()


def test_max_bytes_bounds_the_record_below_redis_maxmemory(redis_server):
    store = make_store(redis_server.url, max_bytes=2 * VALUE_BYTES + 8192)  # this Redis has no maxmemory
    for i in range(4):
        put_all(store, [big_segment(10 * i)])
    assert store.stats()["byte_budget"] == store.max_bytes and store.used_bytes <= store.max_bytes
    assert sorted(store.keys()) == sorted(big_segment(10 * i).key for i in (2, 3))
    store.close()


def test_an_epoch_key_evicted_alone_is_no_reset_and_a_flush_still_is(redis_server):
    """Under allkeys-lru a busy Redis evicts the epoch key like any other: read as a Redis flushed, every replica
    forgot everything it knew and wrote every path again. A segment known here still in Redis shows it was not."""
    store = make_store(redis_server.url)
    tokens = list(range(300, 312))
    put_all(store, chain(tokens, [0, 4, 8], snapshot_at={8}))
    r = redis_server.client()
    r.delete(store.names.epoch())  # what allkeys-lru did
    put_all(store, chain(tokens, [0, 4, 8, 12], snapshot_at={8, 12})[2:])
    assert store.faults == {"epoch_evicted": 1} and len(store) == 3
    r.flushall()
    put_all(store, chain(list(range(400, 404)), [0, 4]))
    assert store.faults == {"epoch_evicted": 1, "redis_reset": 1} and len(store) == 0  # (the one just written too)
    store.close()
