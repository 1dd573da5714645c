"""The prefix cache's admission contract, on the real cache of the demo engine: admit reads a request
(CacheRequest) and returns what it resumed (Admission) for the scheduler to apply; it holds the resumed
pages and the matched path until release, and writes nothing of the request's."""

from __future__ import annotations

from cairn.cache.base import CacheRequest
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(5 * j + 1) % 250 for j in range(40)]


def warm_llm() -> LLM:
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              snapshot_interval=16)
    llm.generate(PROMPT, GREEDY)  # snapshots at 16 and 32 (grid), 40 (prompt end, with its logits), ...
    llm.engine.cache.speeds.prefill_tokens_per_s = 1e-3  # the planner then always takes the deepest point
    return llm


def release(llm: LLM, admission, req: CacheRequest) -> None:
    """What the scheduler does when the request stops: tell the cache, then free the pages and the slot."""
    view = CacheRequest(req.token_ids, req.state_slot, admission.page_table, admission.num_cached)
    assert llm.engine.cache.release(admission, view, finished=False) == 0
    llm.engine.kv.allocator.decref(admission.page_table)
    llm.engine.states.free(req.state_slot)


def test_admit_returns_the_resume_point_without_writing_the_request():
    llm = warm_llm()
    engine = llm.engine
    prompt = PROMPT + [9, 9]
    req = CacheRequest(prompt, engine.states.alloc())
    admission = engine.cache.admit(req)
    assert admission.num_cached == 40 and len(admission.page_table) == 5  # KV of [0, 40): five pages of 8
    assert admission.ready_logits is None  # two prompt tokens are left to compute
    assert admission.report.resume_position == admission.report.cached_tokens == 40
    assert admission.report.match_length == 40 and admission.report.snapshots_taken == 0
    assert admission.planned_captures.get(42) == "prompt_end"  # the new prompt's end is planned
    assert req.token_ids == prompt and req.page_table == [] and req.num_computed == 0
    release(llm, admission, req)
    engine.check_integrity()
    assert engine.kv.allocator.num_free + len(engine.cache.page_refs()) == engine.kv.num_pages


def test_admit_of_a_whole_cached_prompt_returns_its_logits_and_release_unlocks_it():
    llm = warm_llm()
    engine = llm.engine
    req = CacheRequest(list(PROMPT), engine.states.alloc())
    admission = engine.cache.admit(req)
    assert admission.num_cached == len(PROMPT) and admission.ready_logits is not None
    release(llm, admission, req)
    assert admission.state is None  # released: a second release is a no-op
    assert engine.cache.release(admission, req, finished=False) == 0
    engine.check_integrity()
    assert engine.kv.allocator.num_free + len(engine.cache.page_refs()) == engine.kv.num_pages


def test_a_client_that_opts_out_is_admitted_cold_with_the_reason():
    llm = warm_llm()
    admission = llm.engine.cache.admit(CacheRequest(list(PROMPT), 0, cache_prompt=False))
    assert (admission.num_cached, admission.page_table, admission.state) == (0, [], None)
    assert admission.report.miss_reason == "opted_out"


def test_a_request_that_opts_out_runs_to_its_end_and_leaves_the_cache_as_it_was():
    """Its steps ask the cache for captures and report after each one, as every request's do: with nothing
    planned for it, nothing is captured, taken or inserted, and it holds nothing when it ends."""
    llm = warm_llm()
    cache = llm.engine.cache
    before = (cache.stats().counters, cache.tree.num_nodes, cache.tree.num_snapshots)
    opted_out = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_prompt=False)
    [out] = llm.generate(PROMPT[:20] + [7] * 30, opted_out)  # a new prompt, long enough for grid points
    assert len(out.token_ids) == 6 and (cache.stats().counters, cache.tree.num_nodes, cache.tree.num_snapshots) \
        == before
    llm.engine.check_integrity()


def test_a_request_ending_where_its_prompt_end_snapshot_was_taken_takes_no_second_one():
    """One sampled token and no decode step: the request ends at its prompt's end, where a snapshot (with the
    logits) was just taken, so its request-end snapshot is that one, not another copy."""
    llm = warm_llm()
    cache = llm.engine.cache
    before = cache.stats()
    prompt = [(7 * j + 3) % 250 for j in range(24)]
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    stats = cache.stats()
    assert stats.counters["snapshots_taken"] == before.counters["snapshots_taken"] + 2  # grid point 16, prompt end 24
    assert stats.taken_by_source["request_end"] == before.taken_by_source["request_end"]
    assert cache.tree.match(prompt).resume_node.snapshot.source == "prompt_end"
    llm.engine.check_integrity()
