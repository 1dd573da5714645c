"""The disk restore path: a snapshot segment read into the tier's reused buffer, verified, and copied into a
working slot (one strided copy per group of equal tensors), leaving nothing that refers to the buffer."""

from __future__ import annotations

import os

import torch

from cairn.cache.disk.namespace import ReadBuffer
from cairn.cache.disk.store import DiskStore
from cairn.cache.segments.segment import Segment, segment_key
from cairn.cache.segments.tier import SegmentTier, snapshot_fields
from cairn.memory.state_pool import StatePool, _evenly_spaced
from cairn.memory.state_spec import LayerState, StateSpec, StateTensor
from tests.harness import same_state, slot_copy, state_pool

DIGEST = "cd" * 32


def filled(pool: StatePool, slot: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for t in pool.read_slot(slot).values():
        t.copy_(torch.randn(t.shape, generator=g))
    return slot_copy(pool, slot)


def snapshot_segment(pool: StatePool, slot: int, tokens: tuple[int, ...], logits: torch.Tensor) -> Segment:
    return Segment(segment_key(None, tokens), None, 0, tokens, b"kv", {}, **snapshot_fields(pool.read_slot(slot)),
                   logits_bytes=logits.numpy().tobytes(), logits_meta={"dtype": "torch.float32", "shape": [4]})


def disk_tier(tmp_path, buffer: ReadBuffer | None) -> SegmentTier:
    return SegmentTier(DiskStore(tmp_path, DIGEST, 1 << 20), page_size=4, restore_buffer=buffer)


def test_restores_through_one_reused_buffer_leave_earlier_restores_intact(tmp_path):
    pool = state_pool(num_layers=3, num_slots=4)
    states = {seed: filled(pool, 0, seed) for seed in (1, 2)}
    tier, logits = disk_tier(tmp_path, ReadBuffer()), {1: torch.arange(4.0), 2: -torch.arange(4.0)}
    keys = {}
    for seed, state in states.items():
        pool.write_slot(0, state)
        segment = snapshot_segment(pool, 0, (seed, 7, 7), logits[seed])
        assert tier.store.put(segment)
        keys[seed] = segment.key
    got_1 = tier.load_snapshot(keys[1], pool, 1)
    got_2 = tier.load_snapshot(keys[2], pool, 2)  # reads into the buffer the first restore used
    assert same_state(slot_copy(pool, 1), states[1]) and torch.equal(got_1, logits[1])
    assert same_state(slot_copy(pool, 2), states[2]) and torch.equal(got_2, logits[2])


def test_a_damaged_file_read_into_the_buffer_is_refused_and_the_next_restore_is_whole(tmp_path):
    pool = state_pool(num_layers=2, num_slots=3)
    tier = disk_tier(tmp_path, ReadBuffer())
    good, bad = filled(pool, 0, 1), filled(pool, 0, 2)
    keys = []
    for state, tokens in ((good, (1,)), (bad, (2,))):
        pool.write_slot(0, state)
        segment = snapshot_segment(pool, 0, tokens, torch.zeros(4))
        assert tier.store.put(segment)
        keys.append(segment.key)
    path = next(tmp_path.glob(f"*/{keys[1].hex()}.seg"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    assert tier.load_snapshot(keys[1], pool, 1) == "corrupt"
    assert torch.equal(tier.load_snapshot(keys[0], pool, 1), torch.zeros(4))
    assert same_state(slot_copy(pool, 1), good)


def test_a_failed_restore_returns_why_with_no_state_left_on_the_tier(tmp_path):
    """The reason travels with the result: "evicted" for a key the store does not hold, "corrupt" for a segment
    without the snapshot its record promised; the tier keeps no "last reason" for the cache to read."""
    pool = state_pool(num_layers=2, num_slots=2)
    tier = disk_tier(tmp_path, ReadBuffer())
    without = Segment(segment_key(None, (8,)), None, 0, (8,), b"kv", {})
    assert tier.store.put(without)
    assert tier.load_snapshot(segment_key(None, (6,)), pool, 1) == "evicted"
    assert tier.load_snapshot(without.key, pool, 1) == "corrupt"
    assert tier.read(segment_key(None, (6,))) == "evicted"
    assert not hasattr(tier, "unreadable_why")
    assert tier.counters["read_missing"] == 2 and tier.counters["read_ok"] == 1


def test_restore_without_a_buffer_gives_the_same_state(tmp_path):
    pool = state_pool(num_layers=2, num_slots=2)
    state = filled(pool, 0, 3)
    tier = disk_tier(tmp_path, None)  # as the remote tier reads: each segment its own bytes
    segment = snapshot_segment(pool, 0, (4, 5), torch.ones(4))
    assert tier.store.put(segment)
    assert torch.equal(tier.load_snapshot(segment.key, pool, 1), torch.ones(4))
    assert same_state(slot_copy(pool, 1), state)


def test_a_group_read_from_one_segment_is_one_strided_view_and_copies_like_its_tensors(tmp_path):
    pool = state_pool(num_layers=3, num_slots=2)
    state = filled(pool, 0, 4)
    tier = disk_tier(tmp_path, None)
    segment = snapshot_segment(pool, 0, (9,), torch.zeros(4))
    assert tier.store.put(segment)
    tensors = SegmentTier.snapshot_of(tier.read(segment.key)).tensors
    for name in ("conv", "recurrent"):
        members = [tensors[f"layer{i}.{name}"] for i in range(3)]
        whole = _evenly_spaced(members)
        assert whole is not None and torch.equal(whole, torch.stack(members))
    assert _evenly_spaced([state["layer0.conv"], state["layer1.conv"]]) is None  # separate storages: per tensor
    pool.write_slot(1, tensors)
    assert same_state(slot_copy(pool, 1), state)


def test_snapshot_tensors_at_offsets_unaligned_to_their_dtype_read_back_exactly(tmp_path):
    # 3 bf16 values (6 bytes) put the next layer's fp32 tensor at an offset that is not a multiple of 4
    entries = (StateTensor("conv", (3,), torch.bfloat16), StateTensor("recurrent", (2, 2), torch.float32))
    pool = StatePool(StateSpec((LayerState(0, entries), LayerState(1, entries))), 2)
    state = filled(pool, 0, 5)
    tier = disk_tier(tmp_path, ReadBuffer())
    segment = snapshot_segment(pool, 0, (3, 1), torch.zeros(4))
    assert [t["offset"] % 4 for t in segment.snapshot_meta["tensors"]] == [0, 2, 2, 0]
    assert tier.store.put(segment)
    assert torch.equal(tier.load_snapshot(segment.key, pool, 1), torch.zeros(4))
    assert same_state(slot_copy(pool, 1), state)


def test_a_read_buffer_grows_to_the_largest_file_and_is_reused():
    buffer = ReadBuffer()
    small = buffer.view(10)
    big = buffer.view(1000)
    assert big.nbytes == 1000 and small.nbytes == 10  # the old view stays valid: the buffer was replaced
    again = buffer.view(500)
    again[:4] = os.urandom(4)
    assert bytes(big[:4]) == bytes(again[:4])  # one buffer: the next read overwrites the last
