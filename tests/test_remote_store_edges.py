"""The Redis segment store's edges against a real redis-server: a breaker that closes again, one that stays open
while Redis stays down (one outage, one warning), the bound on the
segments a replica knows, a segment too large to write (its markers deleted), markers that are not a
writer's (ignored, never waited for), and the URL a log line shows (no password).

Each test starts its own redis-server (tests/redis_server.py), skipped only when none is installed;
the segments and stores are test_remote_store.py's.
"""

from __future__ import annotations

import logging
import time

import pytest

from cairn.cache.remote import client as remote_client
from cairn.cache.remote import store as remote_store
from cairn.cache.remote.client import redacted
from cairn.cache.remote.keys import prefix_keys
from cairn.cache.segments.segment import SegmentLimits
from tests.test_remote_store import NS, PAGE, RedisSegmentStore, chain, make_store, put_all


def test_a_breaker_closes_when_redis_answers_again_and_says_so_once(redis_server, caplog):
    store = make_store(redis_server.url, timeout_s=0.3, cooldown_s=0.2)
    tokens = list(range(300, 308))
    (seg,) = chain(tokens, [0, 8], snapshot_at={8})
    put_all(store, [seg])
    redis_server.pause()
    try:
        assert store.get(seg.key) is None  # times out: the breaker opens
    finally:
        redis_server.resume()
    time.sleep(0.3)  # past the cooldown: the next call tries Redis again
    with caplog.at_level(logging.INFO, logger="cairn.cache.remote.client"):
        assert store.get(seg.key) == seg
        assert store.get(seg.key) == seg
    assert len([r for r in caplog.records if "reachable again" in r.getMessage()]) == 1
    assert store.redis.breaker.num_opened == 1
    store.close()


class StoppedClock:
    """time.monotonic for the breaker, moved by hand: cooldowns pass exactly when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_redis_still_down_after_the_cooldown_reopens_the_breaker_as_the_same_outage(redis_server, monkeypatch,
                                                                                       caplog):
    """The call let through once the cooldown has passed fails again: the breaker is open for another whole
    cooldown, and it is the same outage (one warning, num_opened 1), not a new one per retry."""
    clock = StoppedClock()
    monkeypatch.setattr(remote_client, "time", clock)
    store = make_store(redis_server.url, timeout_s=0.5, cooldown_s=5.0)
    tokens = list(range(320, 328))
    (seg,) = chain(tokens, [0, 8], snapshot_at={8})
    put_all(store, [seg])
    redis_server.kill()
    breaker = store.redis.breaker
    with caplog.at_level(logging.WARNING, logger="cairn.cache.remote.client"):
        assert store.get(seg.key) is None  # refused: the outage starts, the breaker opens until now + 5 s
        clock.now += 4.9
        assert store.get(seg.key) is None and breaker.is_open  # inside the cooldown: Redis is not asked
        clock.now += 0.2
        assert not breaker.is_open
        refuse = store.redis.client.get

        def refused_after_3_s(name):
            clock.now += 3.0  # as a call waiting for its timeout on a slow network
            return refuse(name)
        store.redis.client.get = refused_after_3_s
        assert store.get(seg.key) is None  # let through, refused again, 3 s later
        clock.now += 4.9
        assert breaker.is_open  # a whole cooldown again, counted from the second failure, not from the retry
        assert store.lookup(tokens, [8]) == []  # a miss, not an error, while it stays down
    assert store.faults == {"unavailable": 2, "breaker_open": 2}
    assert breaker.num_opened == 1 and store.stats()["breaker_opened"] == 1
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    store.close(timeout_s=1.0)


def test_a_replica_knows_at_most_max_segments_and_forgets_the_least_recently_used(redis_server):
    forgotten = []
    store = make_store(redis_server.url, max_segments=2, on_evict=forgotten.append)
    segs = [chain([i, i + 1, i + 2, i + 3], [0, 4], snapshot_at={4})[0] for i in (400, 410, 420)]
    put_all(store, segs[:2])
    assert store.put(segs[0])  # known: only touched, so segs[1] is now the least recently used
    put_all(store, segs[2:])
    assert forgotten == [segs[1].key] and sorted(store.keys()) == sorted([segs[0].key, segs[2].key])
    assert store.stats()["forgotten"] == 1
    other = make_store(redis_server.url)  # Redis keeps it: a lookup finds it again
    assert [i.key for i in other.lookup(list(segs[1].tokens), [4])] == [segs[1].key]
    store.close(), other.close()


def test_a_segment_too_large_to_write_is_counted_and_its_markers_are_deleted(redis_server):
    store = make_store(redis_server.url, limits=SegmentLimits(max_section_bytes=16))  # its 64 KV bytes do not fit
    tokens = list(range(500, 508))
    (seg,) = chain(tokens, [0, 8], snapshot_at={8})
    assert store.put(seg)  # queued: the size is found when the writer encodes it
    assert store.flush() and store.markers.flush(5.0)
    r = redis_server.client()
    assert store.faults == {"too_large": 1} and store.keys() == []
    assert not any(r.scan_iter(match=f"cairn:{store.names.namespace}:*"))  # nothing left, no marker to wait for
    store.close()


def test_markers_that_are_not_a_writers_are_ignored_and_never_waited_for(redis_server):
    writer, reader = make_store(redis_server.url), make_store(redis_server.url, wait_s=2.0)
    tokens = list(range(600, 616))
    first, _ = chain(tokens, [0, 8, 16], snapshot_at={8, 16})
    put_all(writer, [first])
    keys = prefix_keys(tokens, [12, 16])
    r = redis_server.client()
    r.set(reader.names.marker(keys[16]), b"not json")  # malformed: no writer id
    r.set(reader.names.marker(keys[12]), b'{"w": "another", "v": 1}')  # another writer's, not an entry
    found = reader.lookup(tokens, [8, 12, 16])
    assert [(i.start_position, i.num_tokens) for i in found] == [(0, 8)]
    assert reader.counted("lookups_waited") == 0
    writer.close(), reader.close()


@pytest.mark.parametrize("url,shown", [
    ("redis://:secret@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://user:secret@h:6380", "rediss://user:***@h:6380"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://h:6379/0?password=secret&cluster=true", "redis://h:6379/0?password=***&cluster=true"),
])
def test_a_url_in_a_log_line_never_shows_its_password(url, shown):
    assert redacted(url) == shown


def test_markers_never_outlive_a_write_that_finishes_before_put_returns(redis_server):
    """The writer deletes a segment's markers after flushing the marker thread. Markers announced only
    after the write was queued (the old order) could be set after the write had already deleted them:
    readers then waited up to 3 s for a segment already there. Here the write finishes while put is
    still announcing (announce waits for the writer), as on a busy machine."""
    store = make_store(redis_server.url)
    announce = store.markers.announce

    def announce_once_the_writer_is_idle(entries):
        store.flush()  # the old order: the segment's write (and its unmark) already ran by now
        return announce(entries)

    store.markers.announce = announce_once_the_writer_is_idle
    (seg,) = chain(list(range(500, 508)), [0, 8], snapshot_at={8})
    assert store.put(seg)
    assert store.flush() and store.markers.flush(5.0)
    r = redis_server.client()
    assert store.get(seg.key) == seg
    assert not any(r.scan_iter(match=f"cairn:{store.names.namespace}:w:*"))  # no marker left to wait for
    store.close()


def test_a_write_that_raises_is_logged_counted_and_forgotten_and_the_writer_keeps_going(redis_server, monkeypatch,
                                                                                         caplog):
    """A bug in a write (not a Redis error, which is a counted miss): the writer thread logs it, the segment is
    counted as write_failed and forgotten (never served from a write that did not happen), and the next write
    lands."""
    store = make_store(redis_server.url)
    broken, fine = chain(list(range(600, 604)), [0, 4]), chain(list(range(700, 704)), [0, 4])
    original = remote_store.encode_segment

    def encode_once_broken(segment, *args):
        if segment.key == broken[0].key:
            raise RuntimeError("a bug while encoding")
        return original(segment, *args)
    monkeypatch.setattr(remote_store, "encode_segment", encode_once_broken)
    with caplog.at_level(logging.ERROR, logger="cairn.cache.remote.writer"):
        assert store.put(broken[0]) and store.flush()
    assert "a background write failed" in caplog.text and store.faults == {"write_failed": 1}
    assert store.info(broken[0].key) is None and store.keys() == []
    put_all(store, fine)
    assert store.keys() == [fine[0].key] and redis_server.client().exists(store.names.segment(fine[0].key))
    store.close()


def test_closing_finishes_even_when_the_client_refuses_to_close_and_a_second_close_does_nothing(redis_server,
                                                                                                  caplog):
    """`LLM.close()` inside a `with LLM(...)` block closes the cache twice; a connection that fails as it closes
    is logged at debug level, never raised into the shutdown."""
    store = make_store(redis_server.url)
    put_all(store, chain(list(range(800, 804)), [0, 4]))

    def refuse():
        raise ConnectionError("the connection broke while closing")
    store.redis.client.close = refuse
    with caplog.at_level(logging.DEBUG, logger="cairn.cache.remote.client"):
        store.close()
    assert "closing the Redis client failed" in caplog.text
    store.close()
    assert store.faults == {}


def test_a_store_built_with_a_url_of_another_scheme_is_refused_when_built():
    """The store's client parsed its URL only at the first call, on a thread of its own, so a RedisSegmentStore
    built directly with an http:// URL ran with every call failing as a counted fault."""
    with pytest.raises(ValueError, match="must be a redis://, rediss:// or redis\\+cluster:// URL"):
        RedisSegmentStore("http://127.0.0.1:6379/0", NS, PAGE)
