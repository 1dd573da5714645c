"""A slow or dying Redis under running requests: engines (replicas) of the demo model on a real redis-server.

The engine is stepped by hand here, so that Redis can be paused (SIGSTOP: connections still open, nothing
answers, every call waits for the client's timeout) or killed between two steps of a request. Nothing is
timed: a stall is counted in engine steps (tokens a running stream got while a lookup was waiting on Redis).
"""

from __future__ import annotations

import time

import pytest

from cairn.cache.remote.lookups import PENDING
from cairn.cache.tree.nodes import REMOTE
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams
from tests.harness import G, run, same_as_cold
from tests.test_remote_tier import CONVERSATION, OPTS, remote, replica, served_on_a

STREAM = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cold():
    return LLM(**OPTS, prefix_cache=False)


def collect(engine, outputs: dict[str, list[int]], logprobs: dict[str, list[float]] | None = None) -> list:
    """One engine step; its tokens (and logprobs) appended per request id; returns the step's outputs."""
    step = engine.step()
    for out in step:
        assert out.error is None, out.error
        outputs.setdefault(out.request_id, []).extend(out.delta_token_ids)
        if logprobs is not None:
            logprobs.setdefault(out.request_id, []).extend(out.delta_logprobs)
    return step


def finish(engine, outputs: dict, logprobs: dict | None = None) -> None:
    while engine.has_unfinished():
        collect(engine, outputs, logprobs)
    engine.check_integrity()


def looked_up(engine, prompt: list[int], outputs: dict, logprobs: dict | None = None) -> str:
    """Add the request and step once, which starts its Redis lookup; return its id once the lookup has found
    the chain (admission, at the next step, loads it)."""
    request_id = engine.add_request(prompt, G)
    collect(engine, outputs, logprobs)
    lookups = engine.cache.remote.lookups[REMOTE]
    while lookups.answer(prompt) is PENDING:
        time.sleep(0.01)
    assert lookups.answer(prompt)  # Redis held the chain
    return request_id


def equal_to_cold(cold: LLM, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
    ref = cold.generate(prompt, G)[0]
    assert tokens == ref.token_ids
    assert max(abs(a - b) for a, b in zip(logprobs, ref.logprobs, strict=True)) < 1e-4


def test_a_slow_redis_lookup_never_stalls_a_running_stream(redis_server, cold):
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        guarded = remote(b).store.redis
        assert guarded.client is None  # not connected yet: B's calls will wait up to 60 s on a paused Redis
        guarded.timeout_s = 60.0
        engine, outputs, logprobs = b.engine, {}, {}
        stream = engine.add_request(list(range(100, 140)), STREAM)
        while not outputs.get(stream):
            collect(engine, outputs)
        redis_server.pause()  # from now on every Redis call waits, until resume()
        late = engine.add_request(prompt, G)
        lookups = engine.cache.remote.lookups[REMOTE]
        collect(engine, outputs, logprobs)  # admission starts the lookup of `late` and does not wait for it
        before = len(outputs[stream])
        for _ in range(4):  # a lookup made on the engine thread would block the first of these steps for good
            assert lookups.answer(prompt) is PENDING
            collect(engine, outputs, logprobs)
        assert len(outputs[stream]) - before == 4 and late not in outputs  # a token per step; `late` waits
        assert engine.cache.counters["admissions_awaiting_remote"] >= 4
        redis_server.resume()  # the lookup's answer comes in: `late` is admitted and resumes from Redis
        finish(engine, outputs, logprobs)
        assert len(outputs[stream]) == STREAM.max_tokens
        equal_to_cold(cold, prompt, outputs[late], logprobs[late])
        assert engine.cache.restored_by_tier[REMOTE] == 1 and b.engine.cache.stats().remote.faults == {}


def test_redis_killed_during_a_long_prefill_and_its_write_behind_leaves_requests_as_cold(redis_server, cold):
    with replica(redis_server.url) as a:
        engine, outputs, logprobs = a.engine, {}, {}
        first = engine.add_request(list(CONVERSATION), G)
        while not any(seq.num_computed for seq in engine.scheduler.running):
            collect(engine, outputs, logprobs)
        assert not outputs.get(first)  # in its prefill (430 tokens, 96 per step)
        redis_server.kill()
        finish(engine, outputs, logprobs)
        equal_to_cold(cold, CONVERSATION, outputs[first], logprobs[first])
        remote(a).store.flush()
        prompt = CONVERSATION + outputs[first] + [5, 6, 7]
        again = run(a, prompt)  # resumes from its own device tier
        assert again.cache.resume_tier == "device" and again.cache.cached_tokens >= len(CONVERSATION)
        same_as_cold(cold, again, prompt)


def test_redis_killed_while_writes_are_behind_leaves_requests_as_cold(redis_server, cold):
    with replica(redis_server.url) as a:
        remote(a).store.redis.timeout_s = 60.0  # (before it connects) writes wait on a paused Redis until killed
        first = run(a, CONVERSATION)  # its segments queue at release and the writer sends them
        assert remote(a).store.flush()
        second_prompt = CONVERSATION[:200] + list(range(200, 258))
        a.engine.cache.prefetch(second_prompt, []).result(timeout=30)  # looked up before the pause: admission uses it
        redis_server.pause()
        second = run(a, second_prompt)  # its writes are queued behind a Redis that does not answer
        assert remote(a).store.stats()["queued"] >= 1
        redis_server.kill()
        same_as_cold(cold, first, CONVERSATION)
        same_as_cold(cold, second, second_prompt)
        remote(a).store.flush()
        third_prompt = second_prompt + second.token_ids + [5]
        third = run(a, third_prompt)
        assert third.cache.resume_tier == "device"
        same_as_cold(cold, third, third_prompt)
        assert sum(a.engine.cache.stats().remote.faults.values()) >= 1
        a.engine.check_integrity()


def test_redis_killed_between_the_lookup_and_the_load_resumes_cold(redis_server, cold):
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        engine, outputs, logprobs = b.engine, {}, {}
        late = looked_up(engine, prompt, outputs, logprobs)
        redis_server.kill()
        finish(engine, outputs, logprobs)  # admission finds the chain, its load fails: cold, not an error
        equal_to_cold(cold, prompt, outputs[late], logprobs[late])


def test_a_redis_out_of_reach_during_the_load_marks_nothing_bad_and_the_next_request_resumes_from_it(
        redis_server, cold):
    """Redis paused (nothing answers) between B's lookup and its load: the load fails, the request is admitted
    cold and its resume counted "unavailable". The segments were not bad: once Redis answers again, the prompt
    resumes from Redis (the first request is aborted after one step, so that B holds no deeper copy of its own).
    Before, the failed load marked them bad ("corrupt"), and a lookup never hung them again."""
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        remote(b).store.redis.breaker.cooldown_s = 0.0  # the call after the outage goes through at once
        engine = b.engine
        late = looked_up(engine, prompt, {})
        redis_server.pause()
        try:
            collect(engine, {})  # admission: the load waits for the client's timeout, fails, and starts cold
        finally:
            redis_server.resume()
        assert engine.cache.resume_failures == {"unavailable": 1}
        assert remote(b).counters["read_unavailable"] == 1 and "read_bad" not in remote(b).counters
        engine.abort(late)
        finish(engine, {})
        again = run(b, prompt)
        assert again.cache.resume_tier == REMOTE and again.cache.cached_tokens >= len(CONVERSATION) // 64 * 64
        same_as_cold(cold, again, prompt)


def test_a_redis_restarted_empty_under_a_running_replica_gets_the_whole_conversation_written_again(redis_server, cold):
    """Replica A wrote a conversation to Redis; Redis restarts empty while A runs. A's next turn resumes from its
    own device tier, and its write must not be the new end alone (its parents are gone: a chain nobody can
    resume): A notices the lost epoch key and writes the path whole, so replica B resumes the turn after from
    Redis, as cold."""
    a, prompt = served_on_a(redis_server.url)
    with a:
        redis_server.restart_empty()
        out = run(a, prompt)
        assert out.cache.resume_tier == "device"
        assert remote(a).store.flush()
        assert a.engine.cache.stats().remote.faults.get("redis_reset") == 1
        following = prompt + out.token_ids + [8, 9]
    with replica(redis_server.url) as b:
        got = run(b, following)
        assert got.cache.resume_tier == REMOTE and got.cache.cached_tokens >= len(prompt)
        same_as_cold(cold, got, following)


def test_a_redis_refusing_writes_at_its_maxmemory_still_answers_lookups(redis_server, cold):
    """Redis's default maxmemory policy (noeviction) refuses every write once full, with an error answer: the
    replica counts the refused write and keeps reading (the breaker, which skips every call as for a Redis that
    is down, stays closed), so a conversation already stored resumes from Redis as cold."""
    a, prompt = served_on_a(redis_server.url)
    with a, replica(redis_server.url) as b:
        redis_server.client().config_set("maxmemory-policy", "noeviction")
        redis_server.client().config_set("maxmemory", "1")  # full: every write is refused from now on
        run(b, list(range(100, 220)))  # another conversation: its write-behind is refused
        assert remote(b).store.flush()
        remote_stats = b.engine.cache.stats().remote
        assert remote_stats.faults.get("refused", 0) >= 1
        assert remote_stats.operations["segments_written"] == 0 and remote_stats.operations["segments_queued"] >= 1
        out = run(b, prompt)
        assert out.cache.resume_tier == REMOTE and out.cache.cached_tokens >= len(CONVERSATION)
        same_as_cold(cold, out, prompt)
