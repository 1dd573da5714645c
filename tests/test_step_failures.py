"""A failure inside an engine step fails only the requests it touched, and every slot, KV page and cache
lock they held is free again (DESIGN invariant 7); the server's health says when the engine cannot make
progress. Failures are injected into the real engine on the demo model, with the prefix cache on."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import pytest

from cairn.cache import hybrid as hybrid_cache
from cairn.engine.engine import Engine, StepFailed
from cairn.engine.llm import LLM
from cairn.engine.outputs import accumulate
from cairn.request.sampling_params import SamplingParams
from cairn.server.engine_io.bridge import UNHEALTHY_AFTER_FAILED_STEPS, EngineBridge, Submission
from cairn.server.engine_io.offload import Offload

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(5 * j + 1) % 250 for j in range(40)]
OTHER = [(3 * j + 7) % 250 for j in range(30)]


class Injected(RuntimeError):
    """The failure the tests inject."""


def make_engine() -> Engine:
    return LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
               snapshot_interval=16).engine


def run(engine: Engine, prompt: list[int]) -> list[int]:
    request_id = engine.add_request(prompt, GREEDY)
    answers = {}
    while True:
        for out in engine.step():
            answer = accumulate(answers, out)
            if out.request_id == request_id and out.finished:
                return answer.token_ids


def assert_idle(engine: Engine) -> None:
    """Nothing queued or running, every working slot free, no cache lock held, pages and cache bookkeeping
    consistent."""
    assert not engine.has_unfinished()
    assert engine.states.num_free == engine.states.num_slots
    assert not any(node.lock_count for node in engine.cache.tree.iter_nodes())
    engine.check_integrity()
    assert engine.kv.allocator.num_free + len(engine.cache.page_refs()) == engine.kv.num_pages


def fail_once(obj, name: str) -> None:
    """Make obj.name raise Injected on its next call only."""
    original = getattr(obj, name)

    def failing(*args, **kwargs):
        setattr(obj, name, original)
        raise Injected(name)
    setattr(obj, name, failing)


@pytest.mark.parametrize("where", ["runner.run", "cache.after_step", "cache.captures"])
def test_failed_step_frees_every_resource_of_its_requests(where):
    """cache.captures fails while the scheduler completes the batch, outside any one admission: every
    running request is failed."""
    engine = make_engine()
    expected = run(engine, PROMPT)
    engine.cache.speeds.prefill_tokens_per_s = 1e-3  # so the planner never finds a cold prefill faster
    first = engine.add_request(PROMPT + [9, 9], GREEDY)  # resumes from the cache: holds a lock on its path
    second = engine.add_request(OTHER, GREEDY)
    owner, name = where.split(".")
    fail_once(getattr(engine, owner), name)
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert isinstance(failed.value.__cause__, Injected)
    assert sorted(failed.value.request_ids) == sorted([first, second])
    assert_idle(engine)
    assert run(engine, PROMPT) == expected  # and it keeps serving, from its cache too


def test_failed_step_whose_freeing_raises_too_still_frees_slots_and_pages(caplog):
    """The runner raises, then the cache's release of one of the batch's requests raises as well: the
    step still fails with the runner's error, the second failure is logged, and the requests' slots and
    pages are free (the scheduler frees them whatever the cache's release does)."""
    engine = make_engine()
    run(engine, PROMPT)
    engine.cache.speeds.prefill_tokens_per_s = 1e-3
    request_id = engine.add_request(PROMPT + [9, 9], GREEDY)  # resumes from the cache: holds a lock
    fail_once(engine.runner, "run")
    fail_once(engine.cache, "release")
    with caplog.at_level(logging.ERROR, logger="cairn.engine"), pytest.raises(StepFailed) as failed:
        engine.step()
    assert isinstance(failed.value.__cause__, Injected) and str(failed.value) == "Injected: run"
    assert failed.value.request_ids == [request_id]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"freeing {request_id} after a failed step raised too"]
    assert not engine.has_unfinished() and engine.states.num_free == engine.states.num_slots
    assert engine.kv.allocator.num_free + len(engine.cache.page_refs()) == engine.kv.num_pages


# the resume's two steps that can raise: taking the resumed pages (an eviction bug, say: the allocator's
# call is the seam), and copying the snapshot in
@pytest.mark.parametrize("where", ["cache.kv.allocator.incref", "cache.tiers.restore_snapshot"])
def test_failed_admission_fails_only_that_request(where):
    engine = make_engine()
    run(engine, PROMPT)
    alone = run(engine, OTHER)
    bystander = engine.add_request(OTHER, GREEDY)
    answers = {}
    for o in engine.step():  # the bystander is admitted and running
        accumulate(answers, o)
    victim = engine.add_request(PROMPT + [4, 4], GREEDY)  # will resume from a snapshot: make that fail
    engine.cache.speeds.prefill_tokens_per_s = 1e-3  # so the planner never finds a cold prefill faster
    *owner, name = where.split(".")
    fail_once(functools.reduce(getattr, owner, engine), name)
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == [victim]
    assert engine.running_request_ids() == [bystander]
    while engine.has_unfinished():
        for o in engine.step():
            accumulate(answers, o)
    assert answers[(bystander, 0)].finished and answers[(bystander, 0)].token_ids == alone
    assert_idle(engine)


def test_failure_caching_a_finished_request_still_returns_it_and_frees_it(monkeypatch):
    engine = make_engine()
    expected = run(engine, OTHER)

    def failing(*args):
        raise Injected("request_end_allowed")
    monkeypatch.setattr(hybrid_cache, "request_end_allowed", failing)  # caching the request's end raises
    assert run(engine, PROMPT[:20]) == run(make_engine(), PROMPT[:20])
    assert_idle(engine)
    monkeypatch.undo()
    assert run(engine, OTHER) == expected


def test_request_queued_while_every_slot_is_held_waits_and_runs_once_one_is_free():
    """A bug that leaks working slots (here: taken from the pool by hand) leaves a queued request
    waiting, unadmitted and holding nothing, and the engine says it is stalled; once the slots are back
    the request runs and answers as on a healthy engine."""
    engine = make_engine()
    expected = run(engine, PROMPT)
    held = [engine.states.alloc() for _ in range(engine.states.num_free)]
    request_id = engine.add_request(PROMPT, GREEDY)
    assert engine.step() == [] and engine.step() == []
    assert engine.num_waiting == 1 and engine.num_running == 0
    assert engine.stalled() == "every working state slot is held while no request is running"
    for slot in held:
        engine.states.free(slot)
    assert engine.stalled() is None
    answers = {}
    while engine.has_unfinished():
        for out in engine.step():
            accumulate(answers, out)
    assert answers[(request_id, 0)].token_ids == expected
    assert_idle(engine)


def test_integrity_check_finds_an_idle_engine_holding_a_working_slot():
    engine = make_engine()
    run(engine, PROMPT)
    engine.check_integrity()
    slot = engine.states.alloc()  # what a request that finished without freeing its slot would leave
    with pytest.raises(AssertionError, match="an idle engine holds working state slots"):
        engine.check_integrity()
    engine.states.free(slot)
    engine.check_integrity()


def test_aborting_a_queued_request_frees_it():
    engine = make_engine()
    request_id = engine.add_request(PROMPT, GREEDY)
    engine.abort(request_id)
    assert_idle(engine)


# ---- health -----------------------------------------------------------------------------------------

def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


async def _complete(bridge: EngineBridge, request_id: str, prompt: list[int]) -> str:
    """'ok' when the request finished, else the name of the error its stream raised."""
    stream = await bridge.submit(Submission(request_id, GREEDY, prompt=prompt))
    try:
        async for _ in stream:
            pass
    except Exception as e:
        return type(e).__name__
    return "ok"


def test_health_is_503_after_failed_steps_in_a_row_and_200_once_a_step_succeeds():
    engine = make_engine()
    original = engine.runner.run
    engine.runner.run = lambda batch: (_ for _ in ()).throw(Injected("run"))
    bridge = EngineBridge(engine, Offload(engine.tokenizer, engine.max_model_len))  # submit tokenizes there
    bridge.start()
    try:
        for i in range(UNHEALTHY_AFTER_FAILED_STEPS):
            assert bridge.unhealthy() is None
            assert asyncio.run(_complete(bridge, f"r{i}", PROMPT)) == "EngineFailure"
        assert "steps failed" in bridge.unhealthy()
        engine.runner.run = original
        assert asyncio.run(_complete(bridge, "ok", PROMPT)) == "ok"
        assert bridge.unhealthy() is None
        assert asyncio.run(bridge.call(lambda e: assert_idle(e))) is None
    finally:
        bridge.stop(timeout_s=10)
    assert bridge.unhealthy() == "The engine thread is not running."


def test_health_is_503_while_every_slot_is_held_and_nothing_runs():
    engine = make_engine()
    bridge = EngineBridge(engine)
    bridge.start()
    try:
        held = asyncio.run(bridge.call(lambda e: [e.states.alloc() for _ in range(e.states.num_free)]))
        asyncio.run(bridge.call(lambda e: None))  # one more loop: the bridge re-reads the engine's state
        wait_for(lambda: bridge.unhealthy() is not None)
        assert "slot" in bridge.unhealthy()
        asyncio.run(bridge.call(lambda e: [e.states.free(s) for s in held]))
        wait_for(lambda: bridge.unhealthy() is None)
    finally:
        bridge.stop(timeout_s=10)
