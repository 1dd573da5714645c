"""The Redis store while a real redis-server is paused (SIGSTOP: the kernel accepts, nothing answers): a segment
still queued behind the stalled write is read from this process's memory, never from Redis, and lands once
Redis answers again, where another replica finds it by the prompt alone.
"""

from __future__ import annotations

import time

from tests.test_remote_store import chain, make_store, put_all


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


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


def test_a_snapshot_segment_refused_by_a_full_queue_takes_its_markers_back(redis_server):
    """Its markers were announced before the write was refused: left set, other replicas would wait for it."""
    store = make_store(redis_server.url, timeout_s=10.0, queue_segments=2)  # the markers' queue holds 2 as well
    plain = [chain([i, i + 1, i + 2, i + 3], [0, 4])[0] for i in (10, 20, 30)]  # no snapshot: no markers
    (with_snapshot,) = chain([40, 41, 42, 43], [0, 4], snapshot_at={4})
    redis_server.pause()
    try:
        assert store.put(plain[0])
        wait_until(store._writer._queue.empty)  # the writer took it off its queue and hangs on the paused Redis
        assert store.put(plain[1]) and store.put(plain[2])  # queued behind it: the queue is full
        assert not store.put(with_snapshot)  # its markers are announced, then its write is refused: withdrawn
        assert store.faults == {"queue_full": 1} and store.info(with_snapshot.key) is None
    finally:
        redis_server.resume()
    assert store.flush(timeout_s=10.0) and store.markers.flush(timeout_s=10.0)
    r = redis_server.client()
    assert not any(r.scan_iter(match=f"cairn:{store.names.namespace}:w:*"))  # set, then taken back
    assert [r.exists(store.names.segment(s.key)) for s in plain] == [1, 1, 1]
    store.close()


def test_a_known_segment_written_again_with_its_snapshot_and_refused_is_known_as_before(redis_server):
    """A segment the store holds without a snapshot, written again once the node has one, and refused (the queue
    is full behind a paused Redis): what was known of it before is known again, so the tree keeps its reference
    (nothing evicted), the chain can still grow below it, and Redis still serves the segment it holds."""
    evicted = []
    store = make_store(redis_server.url, timeout_s=10.0, queue_segments=2, on_evict=evicted.append)
    tokens = list(range(50, 58))
    (plain,) = chain(tokens, [0, 4])
    put_all(store, [plain])
    before = store.info(plain.key)
    with_snapshot, child = chain(tokens, [0, 4, 8], snapshot_at={4, 8})
    assert with_snapshot.key == plain.key and not before.has_snapshot
    others = [chain([i, i + 1, i + 2, i + 3], [0, 4])[0] for i in (60, 70, 80)]
    redis_server.pause()
    try:
        assert store.put(others[0])
        wait_until(store._writer._queue.empty)  # the writer hangs on the paused Redis with it
        assert store.put(others[1]) and store.put(others[2])  # the queue is full
        assert not store.put(with_snapshot)  # refused: back to what was known
        assert store.faults == {"queue_full": 1} and store.info(plain.key) == before and evicted == []
        store.check_integrity()
    finally:
        redis_server.resume()
    assert store.flush(timeout_s=10.0)
    assert store.put(child) and store.flush()  # its parent is found by its end, as before the refusal
    assert store.faults == {"queue_full": 1}
    assert store.get(plain.key) == plain  # Redis holds the segment written first
    store.close()
