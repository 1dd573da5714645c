"""The Redis tier on a real redis-server that evicts (a small maxmemory, allkeys-lru), two engines as replicas.

Replica A serves a long conversation turn after turn from its own tiers, writing each turn's new end to Redis,
while other conversations' traffic fills Redis; replica B, which never saw the conversation, then resumes it from
Redis. Redis's LRU ranks keys by their last use: A never reads the conversation's first segments again, so
without the touch of a chain's parents at each write they were the first Redis evicted, and every resume of the
conversation elsewhere went cold. A value found gone at a resume is reported "evicted" (not "corrupt"), and
the request that recomputes the path writes it whole again.
"""

from __future__ import annotations

import time

import pytest

from cairn.cache.tree.nodes import REMOTE
from cairn.engine.llm import LLM
from tests.harness import run, same_as_cold
from tests.redis_server import redis_or_skip
from tests.test_remote_faults import equal_to_cold, finish, looked_up
from tests.test_remote_tier import CONVERSATION, OPTS, remote, replica, served_on_a

MAXMEMORY = 20 << 20  # the conversation's segments (~0.6 MiB each in Redis) fit, with the filler of a turn or two
FILLER_BYTES = 512 << 10
FILLER_PER_TURN = 6  # other conversations' traffic, written between two turns
LRU_TICK_S = 1.1  # Redis's LRU clock counts seconds: keys used within one are equally old to it


@pytest.fixture(scope="module")
def cold():
    return LLM(**OPTS, prefix_cache=False)


def fill(redis, turn: int) -> None:
    """Other conversations' traffic: values Redis's LRU ranks newer than everything written before, and older than
    everything written after."""
    r = redis.client()
    time.sleep(LRU_TICK_S)
    for i in range(FILLER_PER_TURN):
        r.set(f"filler:{turn}:{i}", bytes([i]) * FILLER_BYTES)
    time.sleep(LRU_TICK_S)


def next_prompt(prompt: list[int], reply: list[int], turn: int) -> list[int]:
    return prompt + reply + [5 + turn, 6, 7] + list(range(100, 140))


def holding(url: str) -> LLM:
    """A replica whose device keeps the conversation (its first turns are never read back from Redis)."""
    llm = LLM(**{**OPTS, "kv_cache_gib": 0.5, "state_cache_gib": 0.2}, remote_cache=url)
    remote(llm).store.redis.timeout_s = 5.0
    return llm


def test_a_long_conversation_under_lru_eviction_keeps_resuming_from_redis_as_cold(cold):
    redis = redis_or_skip("--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "allkeys-lru",
                          "--maxmemory-samples", "64")  # (its most: LRU close to exact on these few keys)
    try:
        with holding(redis.url) as a, replica(redis.url) as b:
            prompt = previous = CONVERSATION
            turn = 0
            for _ in range(2):
                for _ in range(3):  # A serves three turns from its own tiers, writing each new end to Redis
                    out = run(a, prompt)
                    assert turn == 0 or out.cache.cached_tokens >= len(previous) - 64, out.cache
                    assert remote(a).store.flush()
                    fill(redis, turn)
                    previous, prompt, turn = prompt, next_prompt(prompt, out.token_ids, turn), turn + 1
                got = run(b, prompt)  # B does not hold the conversation: it resumes from Redis
                assert got.cache.resume_tier == REMOTE and got.cache.cached_tokens >= len(previous) - 64, got.cache
                same_as_cold(cold, got, prompt)
                b.engine.cache.tiers.free_device_pages(10**6)  # and lets it go: next time, Redis again
            assert redis.client().info("stats")["evicted_keys"] > 0  # the filler and the conversation competed
            assert "missing" not in b.engine.cache.stats().remote.faults
    finally:
        redis.stop()


def test_a_value_redis_evicted_before_the_load_is_reported_evicted_and_counted_not_corrupt(redis_server, cold):
    """B's lookup found the chain; Redis then evicted its values (deleted here) before B's admission read them. The
    resume falls back cold, as output; the request reports miss_reason "evicted" ("corrupt" means a value that
    failed verification), counted by reason in cairn_cache_resume_failures_total; the next turn, recomputed and
    written whole again, resumes from Redis on another replica."""
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        engine, outputs, logprobs = b.engine, {}, {}
        late = looked_up(engine, prompt, outputs, logprobs)
        r = redis_server.client()
        names = list(r.scan_iter(match=remote(a).store.names.segment(b"") + "*"))
        assert r.delete(*names) == len(names) >= 2  # what allkeys-lru does under pressure
        finish(engine, outputs, logprobs)
        equal_to_cold(cold, prompt, outputs[late], logprobs[late])
        stats = engine.cache.stats()
        assert stats.resume_failures == {"evicted": 1} and stats.remote.faults == {"missing": 1}
        assert remote(b).counters["read_vanished"] == 1 and "read_bad" not in remote(b).counters
        assert remote(b).store.flush()
    with a, replica(redis_server.url) as c:  # B wrote the path whole at its end
        following = prompt + [8, 9]
        got = run(c, following)
        assert got.cache.resume_tier == REMOTE and got.cache.cached_tokens >= len(CONVERSATION)
        same_as_cold(cold, got, following)
