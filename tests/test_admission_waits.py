"""A resume that finds no free KV page, even after eviction, waits: admit returns None and holds nothing
(the matched path is unlocked, no page is referenced for it), and the same request is admitted once
pages are free again. Driven on the real cache of the demo engine, the pool filled as running
requests would fill it."""

from __future__ import annotations

from cairn.cache.base import CacheRequest
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(5 * j + 1) % 250 for j in range(42)]  # its end, 42, is inside a page of 8: resuming copies that page


def test_a_resume_without_free_pages_waits_holding_nothing_then_is_admitted():
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              snapshot_interval=16)
    llm.generate(PROMPT, GREEDY)
    engine = llm.engine
    engine.cache.speeds.prefill_tokens_per_s = 1e-3  # the planner then always takes the deepest point
    allocator = engine.kv.allocator
    held = allocator.alloc(allocator.num_free)  # every free page taken, as running requests would hold them
    prompt = PROMPT + [9, 9]
    req = CacheRequest(prompt, engine.states.alloc())
    for node in list(engine.cache.tree.iter_nodes()):  # only the path this prompt resumes from stays cached
        if node.parent is not None and node.end > len(PROMPT) and not node.children:
            engine.cache.tree.drop_kv(node, "device")
    refs = engine.cache.page_refs()
    assert engine.cache.admit(req) is None  # the page holding position 42 cannot be copied: wait
    assert engine.cache.page_refs() == refs and allocator.num_free == 0
    assert all(node.lock_count == 0 for node in engine.cache.tree.iter_nodes())
    engine.cache.check_integrity()
    allocator.decref(held)
    admission = engine.cache.admit(req)
    assert admission is not None and admission.num_cached == len(PROMPT)


def test_a_resend_that_fills_the_pool_runs_from_the_start_instead_of_waiting_forever():
    """A prompt within a page of the pool's size, sent again: its resume needs a page beside the cached path it
    holds, and with nothing running none will ever free. It runs from position 0 without the cache (said in
    miss_reason), as a cold engine computes it, and a request queued behind it runs too."""
    opts = dict(kv_cache_gib=0.002, state_cache_gib=0.02, page_size=8, max_num_seqs=4, max_num_batched_tokens=256,
                host_cache_gib=0)
    llm, cold = LLM(**opts), LLM(**opts, prefix_cache=False)
    engine = llm.engine
    big = [(7 * j) % 200 + 20 for j in range(engine.max_model_len - 1)]
    first = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(big, first)
    assert engine.kv.allocator.num_free == 0  # the pool holds the cached path, all of it
    engine.add_request(big, first, request_id="again")
    engine.add_request([5, 6, 7], GREEDY, request_id="behind")
    done = {}
    for _ in range(50):
        if not engine.has_unfinished():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"again", "behind"}
    assert done["again"].cache.miss_reason == "pool_full" and done["again"].cache.resume_position == 0
    assert done["again"].delta_token_ids == cold.generate(big, first)[0].token_ids  # its one token
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.cache.check_integrity()
