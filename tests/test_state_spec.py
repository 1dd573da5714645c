"""Recurrent state as a spec: a pool laid out from named per-layer tensors of mixed mixers (Gated DeltaNet
and Mamba2), its slots copied, written to a disk segment and read back bit for bit, and a model-less
stack of both mixers that resumes from a state captured inside a prefill exactly as the original
continues."""

from __future__ import annotations

import pytest
import torch

from cairn.cache.segments.decode import decode_segment
from cairn.cache.segments.named_bytes import layout_meta
from cairn.cache.segments.segment import Segment, SegmentError, encode_segment, segment_key
from cairn.cache.segments.tier import SegmentTier, snapshot_fields
from cairn.engine.demo import demo_config
from cairn.forward_batch import ForwardBatch
from cairn.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from cairn.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from cairn.layers.recurrent import RecurrentMixer
from cairn.memory.state_pool import StatePool, _evenly_spaced
from cairn.memory.state_spec import LayerState, StateSpec, StateTensor
from cairn.model.hybrid import HybridModel
from cairn.ops import REFERENCE
from tests.harness import same_state, slot_copy
from tests.test_segment import reseal

HIDDEN = 32
GDN = GatedDeltaNetSpec(HIDDEN, num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=8, conv_kernel=4, norm_eps=1e-6)
MAMBA = Mamba2Spec(HIDDEN, num_heads=4, head_dim=8, n_groups=2, state_size=16, conv_kernel=4, chunk_size=16)
DIGEST = "ab" * 32


def mixed_spec(dtype: torch.dtype) -> StateSpec:
    """Layers 0 and 3 Gated DeltaNet, layer 2 Mamba2 (layer 1 would be attention, with no state)."""
    return StateSpec((LayerState(0, GDN.state_entries(dtype)), LayerState(2, MAMBA.state_entries(dtype)),
                      LayerState(3, GDN.state_entries(dtype))))


def filled_pool(dtype: torch.dtype, num_slots: int = 3) -> StatePool:
    pool = StatePool(mixed_spec(dtype), num_slots)
    g = torch.Generator().manual_seed(0)
    for slot in range(num_slots):
        pool.alloc()
        for t in pool.read_slot(slot).values():
            t.copy_(torch.randn(t.shape, generator=g))
    return pool


def test_spec_names_every_layer_tensor_and_groups_equal_shapes():
    spec = mixed_spec(torch.bfloat16)
    assert [key for key, _, _ in spec.tensors()] == [
        "layer0.conv", "layer0.recurrent", "layer2.conv", "layer2.ssm", "layer3.conv", "layer3.recurrent"]
    groups = spec.groups()
    assert [(g.shape, g.dtype, g.members) for g in groups] == [
        ((GDN.conv_dim, 3), torch.bfloat16, ((0, "conv"), (3, "conv"))),
        ((4, 8, 8), torch.float32, ((0, "recurrent"), (3, "recurrent"))),
        ((MAMBA.conv_dim, 3), torch.bfloat16, ((2, "conv"),)),
        ((4, 8, 16), torch.float32, ((2, "ssm"),))]
    expected = 2 * (GDN.conv_dim * 3 * 2 + 4 * 8 * 8 * 4) + MAMBA.conv_dim * 3 * 2 + 4 * 8 * 16 * 4
    assert spec.slot_bytes == expected == StatePool(spec, 2).bytes_per_slot


def test_model_config_spec_is_what_its_recurrent_mixers_declare():
    cfg = demo_config(vocab_size=64)
    with torch.device("meta"):
        model = HybridModel(cfg)
    declared = StateSpec(tuple(LayerState(i, layer.mixer.state_entries(torch.bfloat16))
                               for i, layer in enumerate(model.layers) if isinstance(layer.mixer, RecurrentMixer)))
    assert cfg.state_spec(torch.bfloat16) == declared
    assert [s.layer for s in declared.layers] == list(cfg.linear_layers) == [0, 1, 2, 4, 5, 6]


def test_spec_refuses_repeated_layers_and_names():
    entries = GDN.state_entries(torch.float32)
    with pytest.raises(ValueError):
        StateSpec((LayerState(1, entries), LayerState(1, entries)))
    with pytest.raises(ValueError):
        StateSpec((LayerState(0, (*entries, StateTensor("conv", (2,), torch.float32))),))


def test_layer_views_read_slot_and_copy_to_share_one_layout():
    pool = filled_pool(torch.float32)
    ssm = pool.of_layer(2)["ssm"]
    assert ssm.shape == (3, 4, 8, 16)
    assert torch.equal(pool.read_slot(1)["layer2.ssm"], ssm[1])
    ssm[1].add_(1.0)  # of_layer is a view: the slot sees the write
    assert torch.equal(pool.read_slot(1)["layer2.ssm"], ssm[1])
    other = StatePool.like(pool, 2, "cpu")
    dst = other.alloc(zero=False)
    pool.copy_to(1, other, dst)
    assert same_state(slot_copy(other, dst), slot_copy(pool, 1))
    assert not same_state(slot_copy(pool, 0), slot_copy(pool, 1))


def test_write_slot_refuses_a_missing_or_misshapen_tensor():
    pool = filled_pool(torch.float32)
    tensors = slot_copy(pool, 0)
    with pytest.raises(ValueError, match="layer2.ssm"):
        pool.write_slot(1, {k: v for k, v in tensors.items() if k != "layer2.ssm"})
    with pytest.raises(ValueError, match="layer0.conv"):
        pool.write_slot(1, {**tensors, "layer0.conv": tensors["layer0.conv"][:1]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_snapshot_written_to_a_segment_reads_back_bit_for_bit(dtype):
    pool = filled_pool(dtype)
    tokens = (1, 2, 3)
    segment = Segment(segment_key(None, tokens), None, 0, tokens, b"kv", {}, **snapshot_fields(pool.read_slot(2)))
    assert [t["name"] for t in segment.snapshot_meta["tensors"]] == list(pool.read_slot(2))
    back = decode_segment(bytearray(encode_segment(segment, DIGEST)), DIGEST)
    snap = SegmentTier.snapshot_of(back)
    assert {k: (v.dtype, v.shape) for k, v in snap.tensors.items()} == {
        k: (v.dtype, v.shape) for k, v in pool.read_slot(2).items()}
    pool.write_slot(0, snap.tensors)
    assert same_state(slot_copy(pool, 0), slot_copy(pool, 2))


def test_a_snapshot_whose_layers_are_unevenly_spaced_in_its_segment_is_written_back_tensor_by_tensor():
    """A Mamba2 layer whose conv state has the Gated DeltaNet convs' shape, between two Gated DeltaNet layers:
    the three convs are one group, but their layers' sizes differ, so in the segment's bytes they are not
    evenly spaced; write_slot cannot copy the group as one strided view and copies each tensor."""
    same_conv = Mamba2Spec(HIDDEN, num_heads=4, head_dim=8, n_groups=1, state_size=16, conv_kernel=4, chunk_size=16)
    entries = {0: GDN, 1: same_conv, 2: GDN}
    spec = StateSpec(tuple(LayerState(i, mixer.state_entries(torch.float32)) for i, mixer in entries.items()))
    pool = StatePool(spec, 2)
    written, restored = pool.alloc(), pool.alloc()
    for t in pool.read_slot(written).values():
        t.normal_()
    tokens = (1, 2, 3)
    segment = Segment(segment_key(None, tokens), None, 0, tokens, b"kv", {}, **snapshot_fields(pool.read_slot(written)))
    snap = SegmentTier.snapshot_of(decode_segment(bytearray(encode_segment(segment, DIGEST)), DIGEST))
    assert len(spec.groups()[0].members) == 3  # the convs of layers 0, 1 and 2
    assert _evenly_spaced([snap.tensors[f"layer{i}.conv"] for i in (0, 1, 2)]) is None
    pool.write_slot(restored, snap.tensors)
    assert same_state(slot_copy(pool, restored), slot_copy(pool, written))


def test_segment_whose_snapshot_layout_does_not_cover_its_bytes_is_refused():
    tokens = (4, 5)
    conv = layout_meta([("layer0.conv", "float32", (2, 3))])  # 24 bytes
    with pytest.raises(ValueError):  # the writer refuses it
        encode_segment(Segment(segment_key(None, tokens), None, 0, tokens, b"", {}, bytes(20), conv), DIGEST)
    opaque = layout_meta([("state", "uint8", (20,))])
    data = encode_segment(Segment(segment_key(None, tokens), None, 0, tokens, b"", {}, bytes(20), opaque), DIGEST)
    assert decode_segment(data, DIGEST).snapshot_meta == opaque
    forged = reseal(data.replace(b'"shape":[20]', b'"shape":[21]'))  # checksums recomputed: only the layout is wrong
    with pytest.raises(SegmentError) as e:
        decode_segment(forged, DIGEST)
    assert e.value.reason == "malformed"


# ---- a model-less stack of both mixers on one pool --------------------------------------------------


def stack(seed: int = 0) -> tuple[GatedDeltaNet, Mamba2Mixer]:
    torch.manual_seed(seed)
    gdn, mamba = GatedDeltaNet(GDN, layer=0), Mamba2Mixer(MAMBA, layer=2)
    with torch.no_grad():
        for p in [*gdn.parameters(), *mamba.parameters()]:
            p.copy_(torch.randn_like(p) * 0.3)
        mamba.A_log.copy_(torch.rand_like(mamba.A_log) - 0.5)
    return gdn.eval(), mamba.eval()


def batch(rows: int, query_lens: list[int], context_lens: list[int], slots: list[int], num_decode: int,
          captures=(), capture_pool=None) -> ForwardBatch:
    """What the layers read of a step (no attention layer: no KV pages)."""
    return ForwardBatch(
        input_ids=torch.zeros(rows, dtype=torch.long), positions=torch.zeros(rows, dtype=torch.long),
        query_lens=query_lens, context_lens=context_lens, num_decode=num_decode,
        page_tables=torch.zeros(len(slots), 1, dtype=torch.long), slot_mapping=torch.zeros(rows, dtype=torch.long),
        state_slots=torch.tensor(slots), logits_indices=torch.arange(rows), captures=list(captures),
        capture_pool=capture_pool)


def run(mixers, hidden: torch.Tensor, fb: ForwardBatch, states: StatePool) -> torch.Tensor:
    with torch.no_grad():
        for mixer in mixers:
            hidden = hidden + mixer(hidden, fb, states, REFERENCE)
    return hidden


def test_mixed_stack_resumed_from_a_capture_decodes_exactly_as_the_original_continues():
    mixers = stack()
    spec = StateSpec(tuple(LayerState(m.layer, m.state_entries(torch.float32)) for m in mixers))
    work, snapshots = StatePool(spec, 4), StatePool(spec, 2)
    p, total, steps = 64, 100, 5  # p on both mixers' chunk grids (64 and 16 tokens)
    x = torch.randn(total + steps, HIDDEN, generator=torch.Generator().manual_seed(1))
    original, capturing, restored = work.alloc(), work.alloc(), work.alloc()
    run(mixers, x[:p], batch(p, [p], [p], [original], 0), work)  # a prefill that ends at p
    snap = snapshots.alloc(zero=False)
    run(mixers, x[:total], batch(total, [total], [total], [capturing], 0, [[(p, snap)]], snapshots), work)
    snapshots.copy_to(snap, work, restored)
    assert same_state(slot_copy(work, restored), slot_copy(work, original))
    alone = StatePool.like(work, 1, "cpu")  # the original again, decoded by itself (a slot range, in place)
    work.copy_to(original, alone, alone.alloc(zero=False))
    for t in range(p, p + steps):  # the two sequences decode side by side, slots in descending order (gathered)
        out = run(mixers, x[t].expand(2, HIDDEN), batch(2, [1, 1], [t + 1] * 2, [restored, original], 2), work)
        assert torch.equal(out[0], out[1]), t
        by_itself = run(mixers, x[t:t + 1], batch(1, [1], [t + 1], [0], 1), alone)
        assert (by_itself[0] - out[1]).abs().max().item() < 1e-5, t
    assert same_state(slot_copy(work, restored), slot_copy(work, original))
    assert not same_state(slot_copy(work, restored), slot_copy(snapshots, snap))  # the decode steps moved it on
    assert not same_state(slot_copy(work, capturing), slot_copy(work, original))
