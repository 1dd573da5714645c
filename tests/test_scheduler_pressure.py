"""The scheduler under pressure, on the demo engine: decode rows that preempt each other (and themselves) for
pages, and decode rows that spend a whole step's token budget while a prompt waits in prefill. Every request's
greedy output equals the same request run alone, and the books balance after every step (pages' refcounts
against the running page tables and the cache, checked with requests running)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_checked(llm: LLM, prompts: list[list[int]], params: SamplingParams, watch=None) -> list[list[int]]:
    """Every prompt's output tokens, stepping the engine by hand and checking its books after each step;
    watch(scheduler) is called between steps."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.delta_token_ids
        engine.scheduler.check_integrity()
        if watch is not None:
            watch(engine.scheduler)
    return [tokens[rid] for rid in ids]


@pytest.mark.parametrize("num_seqs,prompt_len,stagger,max_tokens", [(4, 20, 0, 40), (4, 20, 5, 40), (3, 30, 5, 60)])
def test_decode_rows_preempting_each_other_for_pages_keep_every_output(num_seqs, prompt_len, stagger, max_tokens,
                                                                      caplog):
    """Pages for about two of the sequences: a decode row making room preempts later ones (with equal
    prompts every row needs a page in the same step, so a row already preempted this step is skipped), and a
    row with no one left to preempt preempts itself."""
    llm = LLM(kv_cache_gib=0.0004, state_cache_gib=0.02, page_size=8, max_num_seqs=num_seqs,
              max_num_batched_tokens=64, prefix_cache=False)
    prompts = [[(3 * i + j) % 200 + 10 for j in range(prompt_len + stagger * i)] for i in range(num_seqs)]
    with caplog.at_level(logging.INFO, logger="cairn.engine"):
        together = run_checked(llm, prompts, greedy(max_tokens))
    preempted = [r for r in caplog.records if r.getMessage().startswith("preempted ")]
    assert preempted, "the pool was meant to be too small for every sequence at once"
    assert together == [run_checked(llm, [p], greedy(max_tokens))[0] for p in prompts]
    engine = llm.engine
    assert engine.kv.allocator.num_free == engine.kv.num_pages and engine.states.num_free == engine.states.num_slots


def test_a_request_recomputed_after_preemption_reports_how_its_prompt_was_served(caplog):
    """A preempted request is admitted again with its prompt and the tokens it generated, and may resume from a
    snapshot it took itself, past its prompt (req-2 here: prompt 30, resumed at 73). Its cache report (the
    usage's cached_tokens and `cairn` fields) still says what the cache gave its prompt, as the metrics counted
    it at its first token: never more cached tokens than the prompt has."""
    llm = LLM(kv_cache_gib=0.0004, state_cache_gib=0.02, page_size=8, max_num_seqs=3, max_num_batched_tokens=64)
    engine = llm.engine
    prompts = [[(3 * i + j) % 200 + 10 for j in range(20 + 5 * i)] for i in range(3)]
    ids = [engine.add_request(p, greedy(100)) for p in prompts]
    at_first_token, at_finish = {}, {}
    with caplog.at_level(logging.INFO, logger="cairn.engine"):
        while engine.has_unfinished():
            for out in engine.step():
                if out.delta_token_ids and out.request_id not in at_first_token:
                    at_first_token[out.request_id] = dataclasses.replace(out.cache)  # (the report object lives on)
                if out.finished:
                    at_finish[out.request_id] = out.cache
    assert any(r.getMessage().startswith("preempted ") for r in caplog.records), "the pool was meant to be short"
    for rid, prompt in zip(ids, prompts, strict=True):
        first, last = at_first_token[rid], at_finish[rid]
        assert last.cached_tokens <= len(prompt), (rid, last)
        assert (last.cached_tokens, last.resume_position, last.resume_tier, last.resume_source, last.miss_reason) == (
            first.cached_tokens, first.resume_position, first.resume_tier, first.resume_source, first.miss_reason), rid


def test_decode_rows_spending_the_token_budget_hold_a_prefill_back_until_they_leave_room():
    """Requests resumed whole from the cache decode from their first step, so the decode rows can outnumber the
    step's token budget (4) while a new prompt is mid-prefill: it waits, then finishes with its own output."""
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.05, page_size=8, max_num_seqs=8, max_num_batched_tokens=4)
    shared = [(5 * j) % 200 + 10 for j in range(24)]
    fresh = list(range(30, 70))
    params = greedy(12)
    alone = {"shared": run_checked(llm, [shared], params)[0]}
    held_back = []

    def watch(scheduler):
        decoding = [s for s in scheduler.running if not s.in_prefill]
        if len(decoding) >= scheduler.max_num_batched_tokens and any(s.in_prefill for s in scheduler.running):
            held_back.append(len(decoding))

    outputs = run_checked(llm, [shared] * 6 + [fresh], params, watch)
    assert held_back, "no step had the decode rows spend the budget with a prompt mid-prefill"
    assert outputs[:6] == [alone["shared"]] * 6
    assert outputs[6] == run_checked(llm, [fresh], params)[0]


def test_prompt_admitted_with_less_budget_left_than_a_prefill_block_waits_for_its_first_block():
    """With a prefill block (64), a prompt admitted after another took its first block finds 36 tokens of the
    step's budget (100) left: less than a block, so it is admitted (slot and pages) but computes nothing that
    step (nor the next); its blocks come in later steps, and both outputs equal each request run alone."""
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.05, page_size=8, max_num_seqs=2, max_num_batched_tokens=100,
              prefill_block=64, prefix_cache=False)
    prompts = [[(3 * i + j) % 200 + 10 for j in range(120)] for i in range(2)]
    params = greedy(4)
    waited = []

    def watch(scheduler):
        if len(scheduler.running) == 2 and scheduler.running[1].num_computed == 0:
            waited.append(scheduler.running[0].num_computed)

    together = run_checked(llm, prompts, params, watch)
    # the first prompt computes a block, then the rest of its prompt (56 tokens: 44 left), the second nothing
    assert waited == [64, 120]
    assert together == [run_checked(llm, [p], params)[0] for p in prompts]


def test_closing_an_engine_with_requests_running_and_queued_aborts_them_and_frees_every_page_and_slot():
    """An interrupted `LLM` call leaves requests behind: close() aborts the running and the queued ones alike and
    returns their pages and slots; what is left of the pool is the prefix cache's."""
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=2, max_num_batched_tokens=16)
    engine = llm.engine
    for i in range(4):
        engine.add_request([(7 * i + j) % 200 + 10 for j in range(30)], greedy(20))
    engine.step()
    engine.step()
    assert engine.scheduler.running and engine.scheduler.waiting
    engine.close()
    assert not engine.has_unfinished()
    assert engine.kv.allocator.num_free + len(engine.scheduler.cache.page_refs()) == engine.kv.num_pages
    assert engine.states.num_free == engine.states.num_slots
    engine.check_integrity()
