"""A resume that finds no free KV page, even after eviction, waits: admit returns None and holds nothing
(the matched path is unlocked, no page is referenced for it), and the same request is admitted once
pages are free again. Driven on the real cache of the demo engine, the pool filled as running
requests would fill it."""

from __future__ import annotations

from cairn.cache.base import CacheRequest
from cairn.llm import LLM
from cairn.sampling import SamplingParams

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
