"""The engine on the demo model: continuous batching, chunked prefill, admission, preemption, cleanup."""

from __future__ import annotations

import logging

import pytest

from cairn.cache.base import Admission, CacheRequest, NullCache
from cairn.config import EngineConfig
from cairn.engine.engine import Engine
from cairn.engine.llm import LLM
from cairn.engine.outputs import RequestOutput, accumulate
from cairn.errors import QueueFull, RequestTooLarge
from cairn.request.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_llm(**kw) -> LLM:
    """The demo model without the prefix cache, so that every page is free again when requests finish."""
    opts = dict(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                prefix_cache=False)
    return LLM(**{**opts, **kw})


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 for j in range(10 + 9 * i)] for i in range(n)]


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_many_requests_batch_continuously_and_match_running_alone():
    llm = make_llm()
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts(10)]
    outputs, widest_step = {}, 0
    while engine.has_unfinished():
        step = engine.step()
        widest_step = max(widest_step, len(step))
        for o in step:
            accumulate(outputs, o)
    assert widest_step == 4  # max_num_seqs requests advanced together
    for p, out in zip(prompts(10), [outputs[(i, 0)] for i in ids], strict=True):
        assert out.token_ids == llm.generate(p, GREEDY)[0].token_ids
        assert out.finish_reason == "length"
    llm.engine.check_integrity()
    assert llm.engine.kv.allocator.num_free == llm.engine.kv.num_pages


class StepEnds(NullCache):
    """A test double of the cache interface that records where each step left a sequence."""

    def __init__(self):
        self.seen = []

    def after_step(self, adm: Admission, req: CacheRequest, logits) -> int:
        self.seen.append(req.num_computed)
        return 0


def test_each_step_stays_within_the_token_budget():
    llm = make_llm(max_num_batched_tokens=16)
    cache = StepEnds()
    engine = Engine(llm.engine.config, cache=cache)
    engine.add_request(list(range(100)), SamplingParams(max_tokens=1, temperature=0.0))
    drain(engine)
    assert cache.seen == list(range(16, 100, 16)) + [100]


def test_a_request_that_can_never_fit_is_refused_with_a_clear_error():
    llm = make_llm(max_model_len=64)
    with pytest.raises(RequestTooLarge, match="context"):
        llm.engine.add_request(list(range(64)), GREEDY)
    with pytest.raises(RequestTooLarge, match="max_tokens"):
        llm.engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestTooLarge, match="empty"):
        llm.engine.add_request([], GREEDY)
    assert llm.generate(list(range(20)), GREEDY)[0].finish_reason == "length"  # and the engine still serves


def context_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "--max-model-len" in r.getMessage()]


def test_a_max_model_len_the_kv_pool_cannot_hold_is_cut_to_the_pool_with_one_warning_naming_the_flag(caplog):
    with caplog.at_level(logging.WARNING):
        engine = make_llm(kv_cache_gib=0.01, max_model_len=100_000).engine
    assert engine.max_model_len == engine.kv.num_pages * engine.kv.page_size < 100_000
    (warning,) = context_warnings(caplog)
    assert f"--max-model-len 100000 cut to {engine.max_model_len} tokens: the KV pool holds no more" in warning
    assert "raise --kv-cache-gib" in warning


def test_a_max_model_len_past_the_models_own_limit_is_cut_to_it_with_one_warning(caplog):
    limit = make_llm().engine.model_config.max_position_embeddings
    with caplog.at_level(logging.WARNING):  # a KV pool that holds more than the model's limit
        engine = make_llm(kv_cache_gib=0.13, max_num_seqs=1, max_model_len=limit + 1).engine
    assert engine.kv.num_pages * engine.kv.page_size > limit == engine.max_model_len
    assert context_warnings(caplog) == [f"--max-model-len {limit + 1} cut to {limit} tokens: the model's "
                                        f"max_position_embeddings is {limit}"]


def test_a_max_model_len_that_fits_or_none_asked_is_used_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert make_llm(max_model_len=64).engine.max_model_len == 64
        make_llm()
    assert context_warnings(caplog) == []


def test_a_burst_on_an_idle_engine_fills_its_free_seats_before_max_waiting_counts():
    """Requests that arrive between two steps all wait for the next one, those it will start at once too: with
    --max-num-seqs 2 --max-waiting 1, a burst of 4 on an idle engine got one accepted and three 429s."""
    engine, params = LLM(max_num_seqs=2, max_waiting=1).engine, SamplingParams(max_tokens=2)
    accepted = [engine.add_request([5 + i, 6, 7], params) for i in range(3)]  # two seats, one queued
    with pytest.raises(QueueFull):
        engine.add_request([9, 6, 7], params)
    done = set()
    while engine.has_unfinished():
        done |= {out.request_id for out in engine.step() if out.request_finished}
    assert done == set(accepted)


def test_admission_waits_for_free_kv_pages_and_everyone_finishes():
    cfg = make_llm().engine.config
    memory = type(cfg.memory)(page_size=8, kv_cache_gib=0.0005, state_cache_gib=0.02)
    engine = Engine(EngineConfig(cfg.model, memory, cfg.scheduler, cfg.cache))
    pages = engine.kv.num_pages
    long = [list(range(i, i + 8 * pages // 2 - 8)) for i in range(3)]  # each needs about half the pool
    ids = [engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)) for p in long]
    max_running, done = 0, set()
    while engine.has_unfinished():
        done |= {o.request_id for o in engine.step() if o.finished}
        max_running = max(max_running, engine.num_running)
    assert done == set(ids) and max_running < 3
    assert engine.kv.allocator.num_free == pages


def test_preempted_requests_are_recomputed_and_their_output_is_unchanged():
    llm = make_llm(kv_cache_gib=0.0004, max_num_seqs=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ps = [list(range(i, i + 20)) for i in range(4)]
    together = llm.generate(ps, params)
    assert [o.token_ids for o in together] == [llm.generate(p, params)[0].token_ids for p in ps]
    assert llm.engine.kv.allocator.num_free == llm.engine.kv.num_pages


def test_aborted_request_releases_its_pages_and_slot():
    engine = make_llm().engine
    rid = engine.add_request(list(range(40)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.allocator.num_free < engine.kv.num_pages
    out = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.kv.allocator.num_free == engine.kv.num_pages
    assert engine.states.num_free == engine.states.num_slots
    assert not engine.has_unfinished()


def test_a_request_id_still_running_is_refused_and_the_running_request_is_untouched():
    """`Engine.add_request(request_id=...)` (the engine is public): an id in use is refused at once; the
    request holding it runs on to its own answer, and once it has finished the id can be used again."""
    engine = make_llm().engine
    engine.add_request(list(range(10)), GREEDY, request_id="mine")
    with pytest.raises(ValueError, match="request id 'mine' is already in use"):
        engine.add_request(list(range(20)), GREEDY, request_id="mine")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["mine"] * GREEDY.max_tokens and outputs[-1].finished
    assert outputs[-1].prompt_token_ids == list(range(10))
    assert engine.add_request(list(range(20)), GREEDY, request_id="mine") == "mine"


def test_aborting_a_request_whose_other_choices_wait_for_its_first_aborts_every_choice():
    """With the prefix cache, choices 1.. of an n > 1 request wait outside the scheduler until the first has
    computed the prompt; an abort then (a client gone before its first token) finishes all of them, and
    nothing is left held or queued."""
    engine = make_llm(prefix_cache=True).engine
    rid = engine.add_request(list(range(30)), SamplingParams(n=3, max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(engine.scheduler.waiting) == 1  # the other two are held
    out = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished() and rid not in engine.choices
    engine.check_integrity()
    assert engine.step() == []


def test_chat_input_is_rendered_with_the_chat_template():
    llm = make_llm()
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, GREEDY)[0]
    expected = llm.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert out.num_prompt_tokens == len(expected)


def output_items(out: RequestOutput) -> int:
    """The list items one output carries: token ids, logprobs and top alternatives."""
    return len(out.delta_token_ids) + len(out.delta_logprobs) + sum(len(top) for top in out.delta_top_logprobs)


def test_each_step_output_carries_only_what_that_step_added():
    """RequestOutput holds deltas: a step's output does not grow with the answer's length (it used to copy the
    whole answer at every step, quadratic in its length), and the deltas add up to the whole answer."""
    llm = make_llm()
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    request_id = llm.engine.add_request(list(range(10)), params)
    items, text_chars, answers = [], 0, {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            items.append(output_items(out))
            text_chars += len(out.delta_text)
            accumulate(answers, out)
    assert items == [1 + 1 + 2] * 60  # the 60th output holds as many items as the first
    answer = answers[(request_id, 0)]
    assert text_chars == len(answer.text)  # no text is sent twice
    whole = llm.generate(list(range(10)), params)[0]
    assert (answer.token_ids, answer.text, answer.logprobs) == (whole.token_ids, whole.text, whole.logprobs)
    assert len(answer.top_logprobs) == 60 and answer.finish_reason == "length"
