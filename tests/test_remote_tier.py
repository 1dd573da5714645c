"""The Redis tier wired into the engine's tier list: two engines (replicas) on one real redis-server.

Each engine is an LLM of the demo model (fp32, greedy) with --remote-cache and no disk or host tier, so
the only way one resumes what the other computed is through Redis. Checked against a cold engine:
a conversation continued on the other replica resumes deep and decodes exactly as cold; a Redis killed
between requests, and values corrupted in Redis, leave every request served (cold or from local tiers),
the corrupted values never loaded and counted.
"""

from __future__ import annotations

import pytest

from cairn.cache.tree.nodes import REMOTE
from cairn.engine.llm import LLM
from cairn.errors import RequestTooLarge
from cairn.server.metrics import cache_families
from tests.harness import G, run, same_as_cold
from tests.redis_server import cluster_or_skip

OPTS = dict(kv_cache_gib=0.05, state_cache_gib=0.02, page_size=8, snapshot_interval=64, max_num_batched_tokens=96)
CONVERSATION = list(range(10, 250)) + list(range(10, 200))  # 430 tokens: grid snapshots at 64, 128, ..., 384


@pytest.fixture(scope="module")
def cold():
    return LLM(**OPTS, prefix_cache=False)


def replica(url: str) -> LLM:
    """A replica whose Redis calls wait up to 5 s (not the default 0.5 s: on a loaded test machine a round
    trip can take that long, and these tests check what is found, not the breaker)."""
    llm = LLM(**OPTS, remote_cache=url)
    remote(llm).store.redis.timeout_s = 5.0  # before its first call: the client is made then
    return llm


def remote(llm: LLM):
    return llm.engine.cache.tiers.by_name[REMOTE]



def served_on_a(url: str):
    """Replica A serves the conversation's first turn and finishes writing it to Redis; (A, next prompt)."""
    a = replica(url)
    reply = run(a, CONVERSATION)
    assert remote(a).store.flush()
    assert remote(a).counters["segments_written"] >= 2
    return a, CONVERSATION + reply.token_ids + [5, 6, 7]


def test_a_conversation_continued_on_another_replica_resumes_from_redis_as_cold(redis_server, cold):
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        assert len(remote(b).store) == 0  # B never saw the conversation: it finds it by the prompt alone
        out = run(b, prompt)
        assert out.cache.resume_tier == REMOTE and out.cache.resume_source == REMOTE
        assert out.cache.cached_tokens >= 0.95 * len(prompt)
        same_as_cold(cold, out, prompt)
        assert remote(b).counters["lookup_hits"] == 1 and b.engine.cache.stats().remote.faults == {}


def test_a_probe_while_the_prompts_lookup_runs_plans_without_it_and_a_later_one_counts_it(redis_server):
    """The router's probe never waits for Redis: asked while the lookup it started is stuck on a paused Redis, it
    answers from the local tiers (cold here, no remote depth); once Redis answers, the next probe hangs what the
    lookup found and plans the resume from Redis."""
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        cache = b.engine.cache
        redis_server.pause()
        try:
            during = cache.probe(prompt)  # starts the lookup, which waits on the paused Redis
        finally:
            redis_server.resume()
        assert (during.position, during.tier, during.remote_position) == (0, None, 0)
        assert cache.prefetch(prompt, []).result(timeout=30)  # the same lookup, answered once Redis resumed
        after = cache.probe(prompt)
        assert after.tier == REMOTE and after.position >= len(CONVERSATION) and after.remote_position > 0


def test_a_redis_killed_between_requests_leaves_every_request_served(redis_server, cold):
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        redis_server.kill()
        out = run(b, prompt)  # nothing local on B: cold
        assert out.cache.cached_tokens == 0
        same_as_cold(cold, out, prompt)
        again = run(a, prompt)  # A resumes from its own device tier and its write-behind fails quietly
        assert again.cache.cached_tokens > 0.9 * len(CONVERSATION) and again.cache.resume_tier == "device"
        same_as_cold(cold, again, prompt)
        assert sum(b.engine.cache.stats().remote.faults.values()) >= 1
        remote(a).store.flush()  # A's failed writes reach its index from the writer thread: forgotten next
        third = run(a, prompt + [9])
        assert third.cache.cached_tokens >= len(prompt) - 1 and third.cache.resume_tier == "device"
        assert sum(a.engine.cache.stats().remote.faults.values()) >= 1


def test_an_empty_prompt_asks_redis_nothing_and_is_refused_as_without_redis(redis_server, cold):
    """The server starts a prompt's lookup (`cache.prefetch`) before the engine checks the prompt, so an empty one
    (a completion of "" or []) reaches the remote tier's lookup with no prefix to probe. It asks Redis nothing:
    while Redis is down and the breaker open, no fault is counted for it; the engine then refuses the prompt
    (RequestTooLarge, the server's 400) as it does without Redis, and the replica serves the next request."""
    with replica(redis_server.url) as b:
        remote(b).store.redis.breaker.cooldown_s = 600.0  # open for the rest of the test once Redis has failed
        redis_server.kill()
        cache, prompt = b.engine.cache, CONVERSATION[:40]
        assert cache.prefetch(prompt, []).result(timeout=30) == []  # refused by Redis: the breaker opens
        assert cache.stats().remote.faults == {"unavailable": 1}
        assert cache.prefetch([], []).result(timeout=30) == []
        with pytest.raises(RequestTooLarge, match="the prompt is empty"):
            b.engine.add_request([], G)
        assert cache.stats().remote.faults == {"unavailable": 1}  # no "breaker_open": Redis was not asked
        assert remote(b).counters["lookups"] == 2
        same_as_cold(cold, run(b, prompt), prompt)


def test_a_value_corrupted_in_redis_is_never_loaded_and_is_counted(redis_server, cold):
    a, prompt = served_on_a(redis_server.url)
    r = redis_server.client()
    prefix = remote(a).store.names.segment(b"")
    names = [n for n in r.scan_iter(match=prefix + "*")]
    assert len(names) >= 2
    for name in names:  # flip one byte in the middle of every segment value
        raw = bytearray(r.get(name))
        raw[len(raw) // 2] ^= 0xFF
        r.set(name, bytes(raw))
    with a, replica(redis_server.url) as b:
        out = run(b, prompt)
        assert out.cache.cached_tokens == 0 and out.cache.miss_reason == "corrupt"
        same_as_cold(cold, out, prompt)
        faults = b.engine.cache.stats().remote.faults
        assert 1 <= faults.get("checksum", 0) <= len(names), faults
        assert run(b, prompt).cache.resume_position > 0  # it cached this run locally and serves it
        # a longer prompt is looked up again: Redis's index still lists the corrupt segments, and the chain found
        # stops at the first one marked unreadable, so none is read again
        again = run(b, prompt + [8, 9])
        assert again.cache.resume_tier == "device" and b.engine.cache.stats().remote.faults == faults


def keys_only_in_redis(llm: LLM) -> set[bytes]:
    """The segments of the tree's nodes whose only KV copy is in Redis."""
    return {node.kv[REMOTE].key for node in llm.engine.cache.tree.iter_nodes() if list(node.kv) == [REMOTE]}


def test_the_known_segments_and_the_nodes_only_in_redis_stay_within_the_cap(redis_server):
    prompts = [[t + 50 * i for t in CONVERSATION[:140]] for i in range(3)]  # 3 conversations, 3+ segments each
    with replica(redis_server.url) as a, replica(redis_server.url) as b:
        for prompt in prompts:
            run(a, prompt)
        assert remote(a).store.flush()
        store, cache = remote(b).store, b.engine.cache
        store.max_segments = 4
        for prompt in prompts:  # B hangs what Redis holds for each (the probe's lookup): nodes only in Redis
            cache.prefetch(prompt, []).result(timeout=60)
            assert cache.probe(prompt).remote_position >= 128
            cache._forget_stale_disk_keys()  # what the next admission, release or probe does first
            assert len(store) <= 4 and len(keys_only_in_redis(b)) <= 4
            cache.check_integrity()
        assert store.stats()["forgotten"] >= 4 and cache.stats().remote.forgotten.get("remote_evicted", 0) >= 4
        out = run(b, prompts[0] + [7])  # forgotten here, still in Redis: found again
        assert out.cache.resume_tier == REMOTE and out.cache.cached_tokens >= 128


def test_the_remote_forgotten_metric_counts_under_the_remote_tiers_reasons_not_the_disks(redis_server, cold):
    """cairn_cache_remote_segments_forgotten_total{reason} says "remote_unreadable" for a segment found corrupt in
    Redis (the disk tier's metric keeps "disk_unreadable" / "disk_evicted"): each index counts under its tier."""
    a, prompt = served_on_a(redis_server.url)
    r = redis_server.client()
    for name in r.scan_iter(match=remote(a).store.names.segment(b"") + "*"):
        raw = bytearray(r.get(name))
        raw[len(raw) // 2] ^= 0xFF
        r.set(name, bytes(raw))
    with a, replica(redis_server.url) as b:
        out = run(b, prompt)
        assert out.cache.miss_reason == "corrupt"
        same_as_cold(cold, out, prompt)
        (family,) = [f for f in cache_families(b.engine.cache.stats())
                     if f.name == "cairn_cache_remote_segments_forgotten"]
        reasons = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
        assert reasons.get("remote_unreadable", 0) >= 1 and set(reasons) <= {"remote_unreadable", "remote_evicted"}


def test_a_conversation_continued_on_another_replica_resumes_from_a_redis_cluster_as_cold(cold):
    cluster = cluster_or_skip(3)
    try:
        a, prompt = served_on_a(cluster.url)
        with a, replica(cluster.url) as b:
            out = run(b, prompt)
            assert out.cache.resume_tier == REMOTE and out.cache.cached_tokens >= 0.95 * len(prompt)
            same_as_cold(cold, out, prompt)
            assert b.engine.cache.stats().remote.faults == {}
        nodes_holding = [n.client().dbsize() for n in cluster.nodes]
        assert sum(1 for n in nodes_holding if n) >= 2, nodes_holding  # the keys spread over the cluster's slots
    finally:
        cluster.stop()
