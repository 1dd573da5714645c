"""The Redis store while a real redis-server is paused (SIGSTOP: the kernel accepts, nothing answers): a segment
still queued behind the stalled write is read from this process's memory, never from Redis, and lands once
Redis answers again, where another replica finds it by the prompt alone.
"""

from __future__ import annotations

from tests.test_remote_store import chain, make_store


def test_a_segment_queued_behind_a_paused_redis_is_read_from_memory_and_lands_when_it_answers(redis_server):
    store = make_store(redis_server.url, timeout_s=10.0)
    first, second = chain(list(range(12)), [0, 4, 12], snapshot_at={12})
    redis_server.pause()
    try:
        assert store.put(first) and store.put(second)  # queued: the writer is stuck on the stalled connection
        assert store.get(second.key) == second  # served from memory, not waiting on Redis
    finally:
        redis_server.resume()
    assert store.flush(timeout_s=10.0)
    replica = make_store(redis_server.url)
    found = replica.lookup(list(range(12)) + [99], [4, 8, 12])
    assert [info.key for info in found] == [first.key, second.key]
    assert replica.get(second.key) == second
    store.close()
    replica.close()
