"""The Redis segment store against a real redis-server that evicts: an epoch key evicted is not taken for a Redis
flushed.

Each test starts its own redis-server (tests/redis_server.py), skipped only when none is installed; the segments
are test_remote_store.py's.
"""

from __future__ import annotations

from tests.test_remote_store import chain, make_store, put_all


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
