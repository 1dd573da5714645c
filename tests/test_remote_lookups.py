"""RemoteLookups' own contract (the threads and bounds around a lookup), with a lookup function that waits
on an event the test sets: the Redis side is tested with a real redis-server in test_remote_faults.py."""

from __future__ import annotations

import logging
import threading

from cairn.cache.remote.lookups import PENDING, RemoteLookups


def gated():
    """(a lookup function that answers [len(tokens)] once `gate` is set, gate, the prompts it was asked)"""
    gate, asked = threading.Event(), []

    def find(token_ids, message_starts, salt_key=None):
        asked.append(list(token_ids))
        assert gate.wait(30)
        return [len(token_ids)]
    return find, gate, asked


def test_an_answer_is_pending_until_the_lookup_returns_and_one_lookup_serves_the_same_prompt():
    find, gate, asked = gated()
    lookups = RemoteLookups(find)
    first, again = lookups.start([1, 2, 3]), lookups.start([1, 2, 3])
    assert first is again and lookups.answer([1, 2, 3]) is PENDING and lookups.answer([9]) is None
    gate.set()
    assert first.result(timeout=30) == [3] and lookups.answer([1, 2, 3]) == [3]
    assert asked == [[1, 2, 3]]
    lookups.close()


def test_lookups_beyond_the_in_flight_cap_answer_a_miss_at_once_and_old_answers_are_forgotten():
    find, gate, _ = gated()
    lookups = RemoteLookups(find, max_answers=3, max_in_flight=2)
    running = [lookups.start([i]) for i in range(2)]
    refused = lookups.start([7])
    assert refused.done() and refused.result() == [] and lookups.counters["lookups_refused"] == 1
    gate.set()
    assert [f.result(timeout=30) for f in running] == [[1], [1]]
    for i in range(2, 6):
        lookups.start([i]).result(timeout=30)
    assert [lookups.answer([i]) for i in range(6)] == [None, None, None, [1], [1], [1]]  # the 3 newest kept
    lookups.close()


def test_close_settles_every_lookup_still_running():
    find, gate, _ = gated()
    lookups = RemoteLookups(find)
    waiting = lookups.start([1, 2])
    lookups.close()
    assert waiting.result(timeout=5) == []
    gate.set()


def test_a_lookup_that_raises_is_a_logged_miss_and_gives_its_place_back(caplog):
    """A bug in the lookup (Redis errors are misses already, in the store): the answer is a miss, logged, and
    its in-flight place is free again, so the next prompt's lookup is not refused by the cap."""
    asked = []

    def broken(token_ids, message_starts, salt_key=None):
        asked.append(list(token_ids))
        raise KeyError("a bug in the lookup")
    lookups = RemoteLookups(broken, max_in_flight=1)
    with caplog.at_level(logging.ERROR, logger="cairn.cache.remote.lookups"):
        assert lookups.start([1, 2]).result(timeout=30) == []
        assert lookups.start([3]).result(timeout=30) == []
    assert "remote lookup failed" in caplog.text and asked == [[1, 2], [3]]
    assert lookups.answer([1, 2]) == [] and "lookups_refused" not in lookups.counters
    lookups.close()


def test_the_probed_depth_is_zero_until_the_answer_is_in():
    """The router's probe never waits for Redis: before a prompt's lookup is started, and while it runs, the
    remote depth it reports is 0."""
    find, gate, _ = gated()
    lookups = RemoteLookups(find)
    assert lookups.deepest_snapshot([1, 2, 3]) == 0  # no lookup yet
    lookups.start([1, 2, 3])
    assert lookups.deepest_snapshot([1, 2, 3]) == 0  # running
    gate.set()
    lookups.close()
