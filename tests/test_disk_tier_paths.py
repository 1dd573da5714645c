"""The disk tier's failure paths on a real engine (demo model, fp32, greedy) and a real cache directory.

A store that refuses every write (a budget smaller than one segment), segments whose parent is gone at
start-up (orphans: never resumable), and a disk tier feeding the Redis tier (segments read back from disk
to be written to Redis): each request is still served as cold serves it, and what happened is counted in
the stats that /metrics exports (`cairn_cache_disk_operations_total{kind}`).
"""

from __future__ import annotations

from pathlib import Path

from cairn.cache.tree.nodes import DISK, REMOTE
from cairn.llm import LLM
from tests.harness import run, same_as_cold

OPTS = dict(kv_cache_gib=0.05, state_cache_gib=0.02, page_size=8, snapshot_interval=64, max_num_batched_tokens=96)
CONVERSATION = list(range(10, 250)) + list(range(10, 200))  # 430 tokens: grid snapshots at 64, 128, ..., 384


def cold_llm() -> LLM:
    return LLM(**OPTS, prefix_cache=False)


def operations(llm: LLM, tier: str = "disk") -> dict[str, int]:
    return getattr(llm.engine.cache.stats(), tier).operations


def test_a_disk_too_small_for_any_segment_fails_each_write_counted_and_serves_as_cold(tmp_path):
    with LLM(**OPTS, disk_cache=str(tmp_path), disk_cache_gib=4096 / 2**30) as llm:
        first = run(llm, CONVERSATION)
        ops = operations(llm)
        assert ops["write_failed"] >= 1 and "segments_written" not in ops
        assert llm.engine.cache.stats().disk.num_segments == 0
        assert all(DISK not in e.handle.copies for _, e, _ in llm.engine.cache.tree.iter_snapshots())
        prompt = CONVERSATION + first.token_ids + [5, 6]
        out = run(llm, prompt)  # the device tier still serves the next turn
        assert out.cache.resume_tier == "device" and out.cache.resume_position >= len(CONVERSATION)
        same_as_cold(cold_llm(), out, prompt)


def test_segments_whose_parent_is_gone_at_restart_are_counted_as_orphans_and_never_resumed(tmp_path):
    with LLM(**OPTS, disk_cache=str(tmp_path)) as first:
        run(first, CONVERSATION)
        store = first.engine.cache.tiers.by_name["disk"].store
        keys = store.keys()
        (root_key,) = [k for k in keys if store.info(k).parent_key is None]
        namespace = Path(store.root) / store.compat_digest
    (namespace / (root_key.hex() + ".seg")).unlink()
    with LLM(**OPTS, disk_cache=str(tmp_path)) as second:
        assert operations(second)["orphan_segments"] == len(keys) - 1  # every other segment chains to the root
        assert second.engine.cache.tree.num_nodes == 0  # nothing hung below the root
        out = run(second, CONVERSATION + [5, 6])
        assert out.cache.cached_tokens == 0
        same_as_cold(cold_llm(), out, CONVERSATION + [5, 6])


def test_a_conversation_indexed_from_disk_is_written_on_to_redis_and_resumed_there_as_cold(tmp_path, redis_server):
    with LLM(**OPTS, disk_cache=str(tmp_path)) as writer:
        reply = run(writer, CONVERSATION)
    prompt = CONVERSATION + reply.token_ids + [5, 6, 7]
    with LLM(**OPTS, disk_cache=str(tmp_path), remote_cache=redis_server.url) as both:
        remote = both.engine.cache.tiers.by_name[REMOTE]
        remote.store.redis.timeout_s = 5.0  # a loaded test machine: this checks what is found, not the breaker
        out = run(both, prompt)  # resumes from disk; its path, read back from the segments, goes to Redis too
        assert out.cache.resume_tier == DISK
        assert remote.store.flush()
        assert operations(both, "remote")["segments_written"] >= 2 and operations(both)["read_ok"] >= 1
    with LLM(**OPTS, remote_cache=redis_server.url) as reader:
        reader.engine.cache.tiers.by_name[REMOTE].store.redis.timeout_s = 5.0
        again = run(reader, prompt + [8])
        assert again.cache.resume_tier == REMOTE and again.cache.resume_position >= len(CONVERSATION)
        same_as_cold(cold_llm(), again, prompt + [8])


def test_a_conversation_leaving_a_stored_one_midway_is_resumed_from_disk_after_a_restart(tmp_path):
    """With exact resumption (--prefill-block, 512 tokens in bf16) no snapshot is taken where a prompt leaves a
    stored conversation inside a block, so the node above the split is a slice of a longer segment. A chain on
    disk continues only from a segment's end: the new conversation's segments chain to the slice's end, and
    without a segment ending there they were orphans at the next start (the remote tier's slice problem)."""
    aligned = dict(OPTS, prefill_block=64)
    with LLM(**aligned, disk_cache=str(tmp_path)) as first:
        run(first, CONVERSATION)  # written through as segments cut at its snapshots (64, 128, ...)
        other = CONVERSATION[:20] + list(range(200, 250)) * 8  # leaves it at 20, inside its first segment
        reply = run(first, other)
        assert operations(first)["slices_rewritten"] == 1
    prompt = other + reply.token_ids + [5, 6, 7]
    with LLM(**aligned, disk_cache=str(tmp_path)) as second:  # the same --disk-cache, nothing in memory
        assert "orphan_segments" not in operations(second)
        out = run(second, prompt)
        assert out.cache.resume_tier == DISK and out.cache.cached_tokens == len(other) // 64 * 64
        same_as_cold(cold_llm(), out, prompt)
        again = run(second, CONVERSATION + [5, 6])  # the stored conversation is still whole
        assert again.cache.resume_tier == DISK and again.cache.cached_tokens == len(CONVERSATION) // 64 * 64
