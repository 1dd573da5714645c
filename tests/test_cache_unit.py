"""Placement rules, the device snapshot tier, non-consuming restore, and the cache's reporting."""

from __future__ import annotations

import logging

import pytest
import torch

from cairn.cache.policy.placement import PlacementInput, PlacementOptions, place, request_end_allowed
from cairn.cache.tiers.pools import DeviceTier
from cairn.engine.llm import LLM
from cairn.memory.kv_pool import KVPool
from cairn.request.sampling_params import SamplingParams
from tests.harness import same_state, slot_copy, state_pool

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _place(**kw):
    inp = dict(prompt_len=1000, resume_position=0, match_length=0, path_has_deeper_snapshot=False)
    opts = {k: kw.pop(k) for k in list(kw) if k in PlacementOptions.__dataclass_fields__}
    return place(PlacementInput(**{**inp, **kw}), PlacementOptions(**{"interval_tokens": 256, **opts}))


def test_grid_is_on_absolute_positions_above_the_resume_point():
    assert _place() == {256: "grid", 512: "grid", 768: "grid", 1000: "prompt_end"}
    assert _place(resume_position=300) == {512: "grid", 768: "grid", 1000: "prompt_end"}
    assert _place(resume_position=512) == {768: "grid", 1000: "prompt_end"}


def test_message_starts_and_branch_point_are_placed_and_each_source_switches_off():
    got = _place(message_starts=(40, 300, 1200), match_length=700, path_has_deeper_snapshot=True)
    assert got == {40: "message", 256: "grid", 300: "message", 512: "grid", 700: "branch", 768: "grid",
                   1000: "prompt_end"}
    assert 700 not in _place(match_length=700, path_has_deeper_snapshot=False)  # the cached path ends there
    off = _place(message_starts=(40,), match_length=700, path_has_deeper_snapshot=True, interval_tokens=0,
                 at_messages=False, at_branch=False, at_prompt_end=False)
    assert off == {}


def test_exact_resumption_places_snapshots_only_on_block_boundaries_and_no_request_end():
    got = _place(message_starts=(40, 300, 1200), match_length=700, path_has_deeper_snapshot=True, align=64)
    assert got == {256: "message", 512: "grid", 640: "branch", 768: "grid", 960: "prompt_end"}  # 40 is below 64
    assert _place(align=64, prompt_len=1024)[1024] == "prompt_end"  # a whole-block prompt end keeps its logits
    assert _place(align=64, resume_position=512) == {768: "grid", 960: "prompt_end"}
    assert request_end_allowed(2000, PlacementOptions()) and not request_end_allowed(2000, PlacementOptions(align=64))


def test_chunks_end_on_block_boundaries_whatever_the_budget_left():
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_batched_tokens=200, max_num_seqs=4,
              prefill_block=64, prefix_cache=False)
    sched = llm.engine.scheduler
    for n in (300, 100):
        llm.engine.add_request([(i * 3) % 200 + 1 for i in range(n)], GREEDY)
    batch = sched.schedule()
    assert batch.num_new_tokens == [192]  # 200 would end inside a block; the second prompt's first block waits
    seq = batch.seqs[0]
    seq.num_computed = 192  # as if the step had run
    assert sched._chunk_len(seq, 100) == 64 and sched._chunk_len(seq, 63) == 0
    assert sched._chunk_len(seq, 108) == 108  # the rest of the prompt, ending in its last, partial block


def test_device_tier_never_exceeds_its_budget_and_restore_does_not_consume():
    work = state_pool()
    kv = KVPool(1, 2, 2, 1, 1, torch.float32)
    tier = DeviceTier(work, 3 * work.bytes_per_slot + 10, vocab_size=5, kv=kv, bandwidth=1e9)
    slot = work.alloc()
    for t in work.read_slot(slot).values():
        t.fill_(1.5)
    stored = [tier.store(work, slot, None) for _ in range(3)]
    assert all(stored) and tier.store(work, slot, None) is None
    assert tier.used_bytes <= tier.budget_bytes
    other = work.alloc()
    for _ in range(2):  # restoring twice gives the same state: the stored copy is not consumed
        tier.load_snapshot(stored[0], work, other)
        assert same_state(slot_copy(work, other), slot_copy(work, slot))
    tier.free_snapshot(stored[0])
    with_logits = tier.store(work, slot, torch.arange(5.0))
    assert with_logits is None  # a slot is free but the logits' bytes would pass the budget
    assert tier.store(work, slot, None) is not None


def test_resuming_never_changes_the_stored_snapshot_or_the_cached_kv():
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, snapshot_interval=32)
    cache = llm.engine.cache
    prompt = list(range(10, 110))
    llm.generate(prompt, GREEDY)
    stored = {pos: (entry.handle.copies["device"].slot, node.pages) for pos, entry, node in cache.tree.iter_snapshots()}
    pool = cache.tiers.device.pool
    before_state = {pos: slot_copy(pool, slot) for pos, (slot, _) in stored.items()}
    before_kv = {pos: llm.engine.kv.k[:, pages].clone() for pos, (_, pages) in stored.items()}
    resumed = []
    for tail in ([1, 2, 3], [4, 5], [6]):  # three branches resume from the same snapshots and run on
        resumed.append(llm.generate(prompt[:70] + tail, GREEDY)[0].cache.resume_position)
    assert resumed == [64, 70, 70]  # the first branch leaves a snapshot at its branch point
    for pos, (slot, pages) in stored.items():
        assert same_state(slot_copy(pool, slot), before_state[pos])
        assert torch.equal(llm.engine.kv.k[:, pages], before_kv[pos])
    llm.engine.check_integrity()


def test_each_prefill_logs_one_debug_line_with_its_cache_figures(caplog):
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, snapshot_interval=32)
    # The start-up copy of one 0.4 MiB slot can measure a few MB/s on a loaded machine, which makes a
    # restore look slower than recomputing 64 tokens: pin a memory-copy speed so the plan is the grid point.
    llm.engine.cache.speeds.bandwidth["device"] = 1e9
    llm.generate(list(range(10, 90)), GREEDY)
    with caplog.at_level(logging.DEBUG, logger="cairn.engine"):  # INFO has the line per finished request
        out = llm.generate(list(range(10, 80)) + [3, 4], GREEDY)[0]
    lines = [r.message for r in caplog.records if r.message.startswith("prefill")]
    assert len(lines) == 1
    assert f"cached={out.cache.cached_tokens}" in lines[0] and "resume=64" in lines[0] and "source=grid" in lines[0]
    assert "new=8" in lines[0] and "snapshots=2" in lines[0] and "snapshots=" in lines[0] and "kv_free=" in lines[0]


@pytest.mark.parametrize("budget_gib", [0.0, 1e-4])
def test_a_full_snapshot_budget_degrades_to_cold_prefill_not_errors(budget_gib):
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, snapshot_interval=16,
              device_snapshot_gib=budget_gib)
    outs = [llm.generate(list(range(10, 100)) + [i], GREEDY)[0] for i in range(3)]
    assert all(len(o.token_ids) == 4 for o in outs)
    assert [o.cache.miss_reason for o in outs[1:]] == ["budget", "budget"]  # reported, not silent
    llm.engine.check_integrity()


def test_snapshots_inside_a_chunk_are_captured_without_splitting_it():
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, snapshot_interval=16, max_num_batched_tokens=96)
    engine = llm.engine
    engine.add_request(list(range(10, 110)), GREEDY)  # 100 tokens: grid snapshots at 16, 32, ..., 96
    steps_to_first_token = 0
    while not any(o.delta_token_ids for o in engine.step()):
        steps_to_first_token += 1
    assert steps_to_first_token == 1  # two steps (96 + 4 tokens), not one per snapshot position
    while engine.has_unfinished():
        engine.step()
    positions = sorted(p for p, _, _ in engine.cache.tree.iter_snapshots())
    assert positions[:6] == [16, 32, 48, 64, 80, 96] and 100 in positions
    engine.check_integrity()
    # and resuming from a captured snapshot equals resuming from one taken at a chunk end
    cold = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, prefix_cache=False)
    prompt = list(range(10, 60)) + [7, 7]
    warm_out = llm.generate(prompt, GREEDY)[0]
    assert warm_out.cache.resume_position == 48
    assert warm_out.token_ids == cold.generate(prompt, GREEDY)[0].token_ids
