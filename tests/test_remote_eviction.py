"""The Redis tier on a real redis-server whose values vanish (evicted under its maxmemory, expired), two engines
as replicas: a value found gone at a resume is reported "evicted" (not "corrupt"), and counted as such.
"""

from __future__ import annotations

import time

import pytest

from cairn.cache.remote.lookups import PENDING
from cairn.cache.tree.nodes import REMOTE
from cairn.llm import LLM
from tests.harness import G
from tests.test_remote_faults import collect, equal_to_cold, finish
from tests.test_remote_tier import OPTS, remote, replica, served_on_a


@pytest.fixture(scope="module")
def cold():
    return LLM(**OPTS, prefix_cache=False)


def test_a_value_redis_evicted_before_the_load_is_reported_evicted_and_counted_not_corrupt(redis_server, cold):
    """B's lookup found the chain; Redis then evicted its values (deleted here) before B's admission read them. The
    resume falls back cold, as output; the request reports miss_reason "evicted" ("corrupt" means a value that
    failed verification), counted by reason in cairn_cache_resume_failures_total."""
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        engine, outputs, logprobs = b.engine, {}, {}
        late = engine.add_request(prompt, G)
        collect(engine, outputs, logprobs)  # starts the lookup
        lookups = engine.cache.remote.lookups[REMOTE]
        while lookups.answer(prompt) is PENDING:
            time.sleep(0.01)
        assert lookups.answer(prompt)
        r = redis_server.client()
        names = list(r.scan_iter(match=remote(a).store.names.segment(b"") + "*"))
        assert r.delete(*names) == len(names) >= 2  # what allkeys-lru does under pressure
        finish(engine, outputs, logprobs)
        equal_to_cold(cold, prompt, outputs[late], logprobs[late])
        stats = engine.cache.stats()
        assert stats.resume_failures == {"evicted": 1} and stats.remote.faults == {"missing": 1}
        assert remote(b).counters["read_vanished"] == 1 and "read_bad" not in remote(b).counters
