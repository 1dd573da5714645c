"""The Redis segment store against a real redis-server that evicts: what a replica believes Redis holds stays
within what Redis can hold (its maxmemory, read with CONFIG GET, or INFO where CONFIG is refused), a write keeps
the parents of what it writes as recently used as it in Redis's LRU, and a value found gone takes what chains
below it out of the record, so the next write of that path is whole.

Each test starts its own redis-server (tests/redis_server.py), skipped only when none is installed; the segments
are test_remote_store.py's.
"""

from __future__ import annotations

import time

from cairn.cache.remote.keys import prefix_keys
from cairn.cache.segments.segment import Segment
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
        assert store.effective_budget_bytes == MAXMEMORY  # cairn_cache_remote_budget_bytes
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


def test_a_write_touches_the_known_parents_it_chains_below_in_redis():
    """Redis's LRU ranks keys by their last use; a conversation grows by children while its parents are not read by
    the replica that holds them, so without the touch its oldest segments were the first Redis evicted."""
    redis = redis_or_skip("--maxmemory-policy", "allkeys-lru")
    store = make_store(redis.url)
    try:
        tokens = list(range(100, 112))
        parents, child = chain(tokens, [0, 4, 8, 12], snapshot_at={8, 12})[:2], chain(tokens, [0, 4, 8, 12])[2]
        put_all(store, parents)
        time.sleep(2.2)  # OBJECT IDLETIME counts whole seconds
        r = redis.client()
        assert all(r.object("idletime", store.names.segment(p.key)) >= 2 for p in parents)
        put_all(store, [child])
        assert all(r.object("idletime", store.names.segment(p.key)) <= 1 for p in parents)
    finally:
        store.close(), redis.stop()


def test_a_value_found_gone_forgets_the_segments_below_it_so_the_next_write_is_whole(redis_server):
    """Redis evicted the middle and the end of a chain; a read finds the middle gone. The end was still believed held,
    so writing the path again sent the middle alone, and a replica resuming the chain found the end gone too."""
    forgotten: list[bytes] = []
    store = make_store(redis_server.url, on_evict=forgotten.append)
    tokens = list(range(200, 212))
    segs = chain(tokens, [0, 4, 8, 12], snapshot_at={4, 8, 12})
    put_all(store, segs)
    r = redis_server.client()
    r.delete(store.names.segment(segs[1].key), store.names.segment(segs[2].key))  # what allkeys-lru did
    assert store.get(segs[1].key) is None
    assert store.faults == {"missing": 1} and forgotten == [segs[1].key, segs[2].key]
    assert store.info(segs[0].key) is not None and store.info(segs[2].key) is None
    store.check_integrity()
    put_all(store, segs)  # the next request over the path writes what is not known: the middle and the end
    reader = make_store(redis_server.url)
    found = reader.lookup(tokens, prefix_keys(tokens, [4, 8, 12]))
    assert [i.key for i in found] == [s.key for s in segs]
    assert all(reader.get(s.key) is not None for s in segs) and reader.faults == {}
    store.close(), reader.close()


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
