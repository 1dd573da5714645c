"""Host and disk tiers on the demo model (fp32): demote before drop, round trips, resume from every tier,
restart, and faults that must fall back to a shallower point or a cold prefill.

The contracts every model family must keep (resume from each tier, host restore without consuming the
host copy, a restart resumed from disk, a disk namespace of its own) run on the demo model and on a tiny
checkpoint of each Mamba2 family (`family`: Nemotron-H, Granite-4.0-H, Falcon-H1; tests/checkpoints.py).
Budgets here are a few snapshots each, so every test moves state between tiers.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from cairn.cache.segments.segment import Segment
from cairn.cache.tree.nodes import Node
from cairn.engine.llm import LLM
from cairn.engine.outputs import accumulate
from cairn.model.families import config_from_hf
from tests.cpu_paths import PATHS
from tests.harness import G, run, same_as_cold, same_state, slot_copy, state_pool

OPTS = dict(kv_cache_gib=0.05, state_cache_gib=0.02, page_size=8, snapshot_interval=64, max_num_batched_tokens=96)
SLOT = 430_080  # bytes of one demo-model state slot
CONVERSATION = list(range(10, 250)) + list(range(10, 200))  # 430 tokens: grid snapshots at 64, 128, ..., 384


@pytest.fixture(scope="module")
def cold():
    return LLM(**OPTS, prefix_cache=False)


FAMILIES = ("demo", "nemotron_h", "granitemoehybrid", "falcon_h1")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str | None:
    """None (the demo model) or a tiny checkpoint directory of the family: the tier contracts hold for each."""
    if request.param == "demo":
        return None
    return str(request.getfixturevalue("checkpoints")[request.param][0])


@pytest.fixture(scope="module")
def family_cold(family):
    return LLM(family, **OPTS, prefix_cache=False)


def slot_bytes(model: str | None) -> int:
    """Bytes of one fp32 state slot of the demo model or of the checkpoint in directory `model`."""
    if model is None:
        return SLOT
    raw = json.loads((Path(model) / "config.json").read_text())
    return config_from_hf(raw).state_spec(torch.float32).slot_bytes


def tiered(tmp_path=None, device_slots=3, host_slots=12, model: str | None = None, **kw) -> LLM:
    slot = slot_bytes(model)
    opts = dict(OPTS, device_snapshot_gib=device_slots * slot / 2**30, host_cache_gib=2 * host_slots * slot / 2**30)
    if tmp_path is not None:
        opts["disk_cache"] = str(tmp_path)
    return LLM(model, **{**opts, **kw})



def handles(llm: LLM) -> dict[int, object]:
    return {pos: entry.handle for pos, entry, _ in llm.engine.cache.tree.iter_snapshots()}


def test_device_eviction_demotes_snapshots_to_host_and_nothing_is_dropped():
    llm = tiered()
    run(llm, CONVERSATION)
    stats = llm.engine.cache.stats()
    assert stats.tier_moves["snapshot device->host"] >= 5
    assert not stats.tier_drops and not stats.dropped_by_reason
    tiers = {pos: set(h.copies) for pos, h in handles(llm).items()}
    assert all(t for t in tiers.values()) and any(t == {"host"} for t in tiers.values())


def test_restoring_from_host_copies_back_and_keeps_the_host_copy(family, family_cold):
    llm = tiered(model=family)
    run(llm, CONVERSATION)
    stats = llm.engine.cache.stats()
    assert stats.tier_moves["snapshot device->host"] >= 1 and not stats.tier_drops
    on_host = sorted(pos for pos, h in handles(llm).items() if set(h.copies) == {"host"})
    prompt = CONVERSATION[: on_host[-1] + 20] + [3, 4, 5]
    out = run(llm, prompt)
    assert out.cache.resume_position == on_host[-1] and out.cache.resume_tier == "host"
    assert "host" in handles(llm)[on_host[-1]].copies  # not consumed
    same_as_cold(family_cold, out, prompt)


def test_kv_pages_move_to_host_under_device_pressure_and_resume_from_there(cold):
    llm = tiered(kv_cache_gib=90 * 8 * 2 * 2 * 2 * 64 * 4 / 2**30)  # 90 pages of 8 tokens: two prompts do not fit
    run(llm, CONVERSATION)
    run(llm, [(t * 7) % 250 + 1 for t in range(400)])  # pushes the first conversation's KV off the device
    stats = llm.engine.cache.stats()
    assert stats.tier_moves.get("kv device->host", 0) > 0
    prompt = CONVERSATION[:300] + [9, 9]
    out = run(llm, prompt)
    assert out.cache.resume_position == 256
    same_as_cold(cold, out, prompt)


def test_round_trip_device_host_disk_device_is_bitwise_equal(tmp_path):
    llm = tiered(tmp_path, device_slots=40, disk_write_through=False)
    run(llm, CONVERSATION)
    cache = llm.engine.cache
    tiers, tree = cache.tiers, cache.tree
    node = next(n for pos, _, n in tree.iter_snapshots() if pos == 256)
    handle = node.snapshot.handle
    pool, slot = tiers.device.pool, handle.copies["device"].slot
    original = slot_copy(pool, slot)
    kv_original = llm.engine.kv.k[:, node.pages].clone()
    tiers.demote_snapshot(node, tiers.device)  # device -> host
    assert tiers.holding(handle.copies)[0].name == "host"
    tiers.demote_snapshot(node, tiers.by_name["host"])  # host -> disk
    assert set(handle.copies) == {"disk"}
    work = llm.engine.states
    slot_b = work.alloc()
    tiers.restore_snapshot(handle, "disk", work, slot_b)  # disk -> device
    assert same_state(slot_copy(work, slot_b), original)
    ref = node.kv["disk"]
    k, _ = tiers.by_name["disk"].kv_of(tiers.by_name["disk"].read(ref.key))
    first = node.start // 8 - ref.segment_start // 8
    assert torch.equal(k[:, first:first + len(node.pages)], kv_original)
    work.free(slot_b)
    cache.check_integrity()


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_resuming_from_each_tier_gives_the_cold_logits(tmp_path, family, family_cold, tier):
    llm = tiered(tmp_path, device_slots=40, model=family, disk_write_through=False)
    run(llm, CONVERSATION)
    cache = llm.engine.cache
    node = next(n for pos, _, n in cache.tree.iter_snapshots() if pos == 320)
    for t in ("device", "host")[: ("device", "host", "disk").index(tier)]:
        if t not in node.snapshot.handle.copies and t == "device":
            continue
        cache.tiers.demote_snapshot(node, cache.tiers.by_name[t])
    prompt = CONVERSATION[:330] + [1, 2]
    out = run(llm, prompt)
    assert out.cache.resume_position == 320 and out.cache.resume_tier == tier
    same_as_cold(family_cold, out, prompt)


def test_a_conversation_resumes_from_disk_after_a_restart(tmp_path, family, family_cold):
    with tiered(tmp_path, model=family) as first:
        reply = run(first, CONVERSATION)
    with tiered(tmp_path, model=family) as second:  # a new process sees the same: nothing in memory, the disk indexed
        prompt = CONVERSATION + reply.token_ids + [5, 6, 7]
        out = run(second, prompt)
        assert out.cache.cached_tokens == len(CONVERSATION) + len(reply.token_ids) - 1
        assert out.cache.resume_tier == "disk"
        same_as_cold(family_cold, out, prompt)


def test_a_prefix_resumed_from_disk_is_put_back_on_the_device_for_the_next_request(tmp_path, cold):
    """After a restart every conversation is on disk only: a resume reads it there once, and the next request
    on the same prefix (another turn, a conversation sharing it) resumes from device memory, as cold."""
    with tiered(tmp_path) as first:
        run(first, CONVERSATION)
    with tiered(tmp_path) as second:
        first_out = run(second, CONVERSATION + [5, 6, 7])
        assert first_out.cache.resume_tier == "disk" and first_out.cache.resume_position > 0
        p = first_out.cache.resume_position
        tree = second.engine.cache.tree
        assert all("device" in node.kv for node in tree.match(CONVERSATION).path if node.end <= p)
        prompt = CONVERSATION + [8, 9]
        out = run(second, prompt)
        assert out.cache.resume_tier == "device" and out.cache.resume_position == p
        same_as_cold(cold, out, prompt)
        moves = second.engine.cache.stats().tier_moves
        assert moves["snapshot disk->device"] >= 1 and moves["kv disk->device"] >= 1


def test_another_model_never_sees_the_segments(tmp_path, family, caplog):
    """And says so at start-up: one line names the other namespaces the directory holds, never read here."""
    with tiered(tmp_path, model=family) as first:
        run(first, CONVERSATION)
    (first_namespace,) = os.listdir(tmp_path)
    other_weights = {"demo_seed": 1} if family is None else {}  # the demo's other weights, or the demo itself
    with caplog.at_level(logging.INFO, "cairn.cache.factory"), tiered(tmp_path, **other_weights) as other:
        assert len(other.engine.cache.tiers.by_name["disk"].store) == 0
        assert run(other, CONVERSATION[:300] + [1]).cache.cached_tokens == 0
    assert len(os.listdir(tmp_path)) == 2
    (line,) = [r.getMessage() for r in caplog.records if "also holds" in r.getMessage()]
    assert f"1 namespace(s) of other models, dtypes or settings ({first_namespace[:16]})" in line


def _segment_files(tmp_path):
    (namespace,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return sorted(namespace.glob("*.seg"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("fault", ["bit_flip", "truncate", "symlink", "zero_length"])
def test_a_damaged_segment_falls_back_and_the_engine_keeps_serving(tmp_path, cold, fault):
    with tiered(tmp_path) as first:
        run(first, CONVERSATION)
    outside = tmp_path.parent / f"outside-{fault}"
    outside.write_bytes(b"not a segment")
    for path in _segment_files(tmp_path):  # damage every segment written
        data = path.read_bytes()
        if fault == "bit_flip":
            path.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
        elif fault == "truncate":
            path.write_bytes(data[: len(data) // 2])
        elif fault == "zero_length":
            path.write_bytes(b"")
        else:
            path.unlink()
            path.symlink_to(outside)
    with tiered(tmp_path) as second:
        prompt = CONVERSATION[:300] + [4, 4]
        out = run(second, prompt)
        assert out.cache.cached_tokens == 0
        same_as_cold(cold, out, prompt)
        faults = second.engine.cache.stats().disk.faults
        assert sum(faults.values()) >= 1
        assert run(second, prompt).cache.resume_position > 0  # it cached this run and serves it
    assert outside.read_bytes() == b"not a segment"


def test_a_segment_corrupted_after_start_up_is_dropped_when_read(tmp_path, cold):
    with tiered(tmp_path) as first:
        run(first, CONVERSATION)
    with tiered(tmp_path) as second:
        for path in _segment_files(tmp_path):  # corrupt after the index was built: found when loading
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        prompt = CONVERSATION[:300] + [4, 4]
        out = run(second, prompt)
        assert out.cache.cached_tokens == 0 and out.cache.miss_reason == "corrupt"
        same_as_cold(cold, out, prompt)
        assert second.engine.cache.stats().resume_failures == {"corrupt": 1}


def test_a_segment_file_deleted_after_start_up_is_a_miss_reported_evicted_not_corrupt(tmp_path, cold):
    """A file deleted under the server (an operator's cleanup, another server's eviction) is a value gone, not one
    that failed verification: miss_reason "evicted", counted apart in cairn_cache_resume_failures_total."""
    with tiered(tmp_path) as first:
        run(first, CONVERSATION)
    with tiered(tmp_path) as second:
        for path in _segment_files(tmp_path):
            path.unlink()
        prompt = CONVERSATION[:300] + [4, 4]
        out = run(second, prompt)
        assert out.cache.cached_tokens == 0 and out.cache.miss_reason == "evicted"
        same_as_cold(cold, out, prompt)
        stats = second.engine.cache.stats()
        assert stats.resume_failures == {"evicted": 1} and set(stats.disk.faults) == {"missing"}
        operations = stats.disk.operations
        assert operations["read_vanished"] == 1 and "read_bad" not in operations
        assert stats.disk.forgotten.get("disk_evicted", 0) >= 1 and "disk_unreadable" not in stats.disk.forgotten


def test_disk_segments_hold_what_the_tree_says(tmp_path):
    with tiered(tmp_path) as llm:
        run(llm, CONVERSATION)
        store = llm.engine.cache.tiers.by_name["disk"].store
        for _, entry, node in llm.engine.cache.tree.iter_snapshots():
            segment: Segment = store.get(entry.handle.copies["disk"])
            assert segment is not None and segment.end_position == node.end
            assert segment.snapshot_bytes is not None


def test_a_store_into_the_host_tier_is_complete_when_it_returns_and_a_full_tier_refuses():
    from cairn.cache.tiers.pools import HostKVBank, HostTier
    from cairn.memory.kv_pool import KVPool

    kv = KVPool(1, 4, 2, 1, 2, torch.float32)
    kv.k.normal_()
    bank = HostKVBank(kv, budget_bytes=2 * kv.bytes_per_page)
    work = state_pool()
    host = HostTier(work, 2 * work.bytes_per_slot + 16, vocab_size=4, kv=bank, bandwidth=1e9)
    slot = work.alloc()
    for t in work.read_slot(slot).values():
        t.normal_()

    class Source:  # what TierSet hands a tier when it demotes: a node's KV and snapshot from their fastest copy
        def node_kv(self, node):
            return kv.read_pages(node.kv["device"])

        def node_snapshot(self, node):
            return work.read_slot(slot), torch.arange(4.0)

    node = Node(1, (5, 6, 7, 8), 0, 4, None, {"device": [1, 3]})
    stored = host.store_snapshot(node, Source())
    assert stored.tier == "host" and stored.nbytes == work.bytes_per_slot + 16 and host.pool.num_free == 1
    assert same_state(slot_copy(host.pool, stored.slot), slot_copy(work, slot))
    assert torch.equal(stored.logits, torch.arange(4.0))
    work.read_slot(slot)["layer0.conv"].add_(1)  # the copy is the host's own: the source changing leaves it
    assert not same_state(slot_copy(host.pool, stored.slot), slot_copy(work, slot))
    assert host.store_snapshot(node, Source()) is None  # a slot is free, but the logits' bytes pass the budget
    pages = host.store_kv(node, Source())
    assert torch.equal(bank.k[:, pages], kv.k[:, [1, 3]])
    assert not host.kv_fits(1) and host.store_kv(node, Source()) is None


def test_write_through_over_segments_deleted_while_a_request_runs_still_finishes_it(tmp_path, cold):
    with tiered(tmp_path) as first:
        run(first, CONVERSATION)
    with tiered(tmp_path) as second:
        engine = second.engine
        prompt = CONVERSATION[:300] + [4, 4]  # resumes from disk; its branch snapshot at 300 splits a disk node
        request_id = engine.add_request(prompt, G)
        answers = {}
        for o in engine.step():
            accumulate(answers, o)
        assert engine._seqs[request_id].cache.resume_tier == "disk"
        for path in _segment_files(tmp_path):  # gone before the write-through rewrites the split node
            path.unlink()
        for o in (o for _ in range(50) for o in engine.step()):
            accumulate(answers, o)
        (out,) = [a for a in answers.values() if a.finished]
        same_as_cold(cold, out, prompt)
        counters = engine.cache.tiers.by_name["disk"].counters  # the split node is written from the request's own pages
        assert counters["write_unreadable"] == 0 and counters["segments_written"] >= 1
        engine.check_integrity()
        again = run(second, prompt)  # the disk copies are gone; the resume put the prefix back on the device
        assert again.cache.resume_tier in ("device", "host") and again.cache.miss_reason is None
        same_as_cold(cold, again, prompt)


@pytest.mark.parametrize("dtype, path", [("bfloat16", path) for path in PATHS] + [("float16", "auto")])
@pytest.mark.parametrize("tier", ["device", "host", "disk", "disk after a restart"])
def test_half_precision_resume_from_each_tier_is_bit_for_bit_cold(tmp_path, tier, dtype, path, sampled_logits):
    """On every CPU path this machine runs (bf16: the compiled ops and the gemv kernel, or the references)."""
    half = dict(dtype=dtype, prefill_block=64, cpu_isa=path)
    restart = tier == "disk after a restart"
    llm = tiered(tmp_path, device_slots=40, disk_write_through=restart, **half)
    run(llm, CONVERSATION)
    cache = llm.engine.cache
    node = next(n for pos, _, n in cache.tree.iter_snapshots() if pos == 320)
    for t in () if restart else ("device", "host")[: ("device", "host", "disk").index(tier)]:
        cache.tiers.demote_snapshot(node, cache.tiers.by_name[t])
    if restart:  # a new process sees the same: nothing in memory, the disk indexed
        llm.close()
        llm = tiered(tmp_path, **half)
    prompt = CONVERSATION[:330] + [1, 2]
    sampled_logits.clear()
    out = run(llm, prompt)
    warm = torch.stack(sampled_logits)
    llm.close()
    assert out.cache.resume_position == 320 and out.cache.resume_tier == tier.split()[0]
    sampled_logits.clear()
    ref = LLM(**OPTS, **half, prefix_cache=False).generate(prompt, G)[0]
    assert out.token_ids == ref.token_ids
    assert torch.equal(warm, torch.stack(sampled_logits))


@pytest.mark.parametrize("written, read", [("gemv", "plain"), ("plain", "gemv")])
def test_a_disk_cache_written_under_another_weight_layout_is_not_resumed_in_exact_mode(tmp_path, written, read):
    """The AVX2 gemv path multiplies a prefill's rows in another order than F.linear: a snapshot computed under
    one layout is not bit for bit what a cold prefill under the other computes, so with --prefill-block (exact
    resumption) the layouts name different namespaces and a restart under the other layout resumes nothing. The
    AVX2 path is forced (the one whose prefill the kernel runs), so any CPU with AVX2 checks it."""
    from cairn.ops import cpu_gemv, cpu_isa

    if isinstance(kernel := cpu_gemv.load(cpu_isa.cpu_flags(), "avx2"), str):
        pytest.skip(f"the AVX2 gemv kernel is unavailable here: {kernel}")
    half = dict(dtype="bfloat16", prefill_block=64, cpu_isa="avx2")
    with tiered(tmp_path, device_slots=40, disk_write_through=True, weight_layout=written, **half) as first:
        run(first, CONVERSATION)
    prompt = CONVERSATION[:330] + [1, 2]
    with tiered(tmp_path, weight_layout=read, **half) as second:
        out = run(second, prompt)
    with LLM(**OPTS, **half, weight_layout=read, prefix_cache=False) as cold:
        ref = cold.generate(prompt, G)[0]
    assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs
    assert out.cache.resume_tier != "disk"
