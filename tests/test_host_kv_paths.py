"""KV pages on the host tier, on a real engine (demo model, fp32, greedy): resumed from there page by page,
and, without write-through, moved on to disk when the host is full, where a restarted engine finds them.

The device's KV is evicted with `evict_pages`, the scheduler's call when it needs pages, so which copy
a request resumes from is known, not left to the pool's size.
"""

from __future__ import annotations

from cairn.cache.tree.nodes import DEVICE, DISK, HOST
from cairn.engine.llm import LLM
from tests.harness import run, same_as_cold

OPTS = dict(kv_cache_gib=0.05, state_cache_gib=0.02, page_size=8, snapshot_interval=64, max_num_batched_tokens=96)
CONVERSATION = list(range(10, 250)) + list(range(10, 200))  # 430 tokens: 54 pages of 8
SLOT = 430_080  # bytes of one demo-model state slot
PAGE = 16_384  # bytes of one demo-model KV page of 8 tokens


def kv_tiers(llm: LLM) -> set[str]:
    return {tier for node in llm.engine.cache.tree.iter_nodes() if node.parent is not None for tier in node.kv}


def evict_all_device_kv(llm: LLM) -> int:
    return llm.engine.cache.evict_pages(llm.engine.kv.num_pages)


def test_kv_evicted_to_the_host_is_copied_back_page_by_page_on_resume():
    host_gib = 2 * 12 * SLOT / 2**30  # half for snapshots, half (about 300 pages) for KV
    with LLM(**OPTS, host_cache_gib=host_gib) as llm, LLM(**OPTS, prefix_cache=False) as cold:
        run(llm, CONVERSATION)
        assert evict_all_device_kv(llm) >= 54
        assert kv_tiers(llm) == {HOST}  # every cached page now lives on the host only
        prompt = CONVERSATION[:300] + [9, 9]
        out = run(llm, prompt)
        assert out.cache.resume_position == 256
        same_as_cold(cold, out, prompt)
        assert llm.engine.cache.stats().tier_moves["kv device->host"] >= 1


def test_without_write_through_what_the_full_host_evicts_goes_to_disk_and_survives_a_restart(tmp_path):
    small_host = dict(host_cache_gib=2 * 20 * PAGE / 2**30, disk_cache=str(tmp_path), disk_write_through=False)
    with LLM(**OPTS, **small_host) as llm:  # 20 host pages, no host snapshot slot; snapshots stay on the device
        run(llm, CONVERSATION)
        assert llm.engine.cache.stats().disk.num_segments == 0  # nothing is written through
        evict_all_device_kv(llm)
        moves = llm.engine.cache.stats().tier_moves
        assert moves["kv device->host"] >= 1 and moves["kv host->disk"] >= 1
        assert DEVICE not in kv_tiers(llm) and DISK in kv_tiers(llm)
        # a node's segment holds its snapshot too, read from the device's copy
        on_disk = max(p for p, e, _ in llm.engine.cache.tree.iter_snapshots()
                      if DISK in e.handle.copies and p <= len(CONVERSATION))
        llm.engine.check_integrity()
    with LLM(**OPTS, disk_cache=str(tmp_path)) as restarted, LLM(**OPTS, prefix_cache=False) as cold:
        prompt = CONVERSATION + [9, 9]
        out = run(restarted, prompt)
        assert out.cache.resume_tier == DISK and out.cache.resume_position == on_disk > 0
        same_as_cold(cold, out, prompt)
