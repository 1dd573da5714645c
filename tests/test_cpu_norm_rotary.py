"""The attention inputs' op (cairn/ops/csrc/norm_rotary.h) against the reference (attention.norm_rotary_write).

q / k RMSNorm, partial rotary and the KV page writes in one C++ op must give the reference's bits: the
returned q and every byte of both pools (the tokens' slots written, every other slot untouched), for one
decode token and many prefill tokens, grouped heads, rotary over part or all of head_dim, bf16 and fp32
norm weights, q as the strided view the gated attention takes. fp32 stays on the reference.
"""

from __future__ import annotations

import pytest
import torch

from cairn.ops import attention, cpu_norm


def bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def case(tokens, heads, kv_heads, dim, rotary_dim, weight_dtype, seed):
    """Inputs as GatedAttention passes them: q a strided half of [q | gate] rows, slots scattered over a pool."""
    q, _ = bf16(tokens, heads, 2 * dim, seed=seed).chunk(2, dim=-1)
    k, v = bf16(tokens, kv_heads, dim, seed=seed + 1), bf16(tokens, kv_heads, dim, seed=seed + 2)
    positions = torch.arange(tokens) * 7 + 3
    freqs = positions.float().unsqueeze(-1) / (10000.0 ** (torch.arange(0, rotary_dim, 2) / rotary_dim))
    emb = torch.cat([freqs, freqs], dim=-1)
    page_size, pages = 4, tokens + 3
    pool = bf16(pages, page_size, kv_heads, dim, seed=seed + 3)
    slots = torch.randperm(pages * page_size, generator=torch.Generator().manual_seed(seed))[:tokens]
    weights = [(bf16(dim, seed=seed + i, scale=0.3)).to(weight_dtype) for i in (4, 5)]
    return dict(q=q, k=k, v=v, q_weight=weights[0], k_weight=weights[1], eps=1e-6, zero_centred=True,
                cos=emb.cos().bfloat16(), sin=emb.sin().bfloat16(), k_pool=pool.clone(), v_pool=pool.clone() * 2,
                slot_mapping=slots)


def run(fn, t):
    t = {**t, "k_pool": t["k_pool"].clone(), "v_pool": t["v_pool"].clone()}
    return fn(**t), t["k_pool"], t["v_pool"]


@pytest.mark.parametrize("tokens, heads, kv_heads, dim, rotary_dim", [
    (1, 8, 2, 256, 64), (1, 4, 4, 64, 64), (3, 6, 2, 100, 20), (257, 4, 1, 96, 32), (2, 2, 2, 48, 0)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_norm_rotary_write_gives_the_reference_bits(tokens, heads, kv_heads, dim, rotary_dim, weight_dtype):
    if cpu_norm._loaded() is None:
        pytest.skip(f"the fused norm op is not used here: {cpu_norm.load()}")
    t = case(tokens, heads, kv_heads, dim, rotary_dim, weight_dtype, seed=tokens + dim)
    ref_q, ref_k, ref_v = run(attention.norm_rotary_write, t)
    got_q, got_k, got_v = run(cpu_norm.norm_rotary_write, t)
    assert same_bits(got_q, ref_q) and same_bits(got_k, ref_k) and same_bits(got_v, ref_v)
    assert not torch.equal(got_k, t["k_pool"])  # the slots were written


def test_norm_rotary_write_leaves_its_inputs_and_other_slots_alone():
    if cpu_norm._loaded() is None:
        pytest.skip(f"the fused norm op is not used here: {cpu_norm.load()}")
    t = case(5, 4, 2, 64, 16, torch.bfloat16, seed=9)
    before = {name: x.clone() for name, x in t.items() if isinstance(x, torch.Tensor)}
    _, k_pool, v_pool = run(cpu_norm.norm_rotary_write, t)
    assert all(torch.equal(t[name], x) for name, x in before.items())
    untouched = torch.ones(k_pool.shape[0] * k_pool.shape[1], dtype=torch.bool)
    untouched[t["slot_mapping"]] = False
    assert torch.equal(k_pool.flatten(0, 1)[untouched], t["k_pool"].flatten(0, 1)[untouched])
    assert torch.equal(v_pool.flatten(0, 1)[t["slot_mapping"]], t["v"])


def test_norm_rotary_write_refuses_a_slot_outside_the_pool():
    if cpu_norm._loaded() is None:
        pytest.skip(f"the fused norm op is not used here: {cpu_norm.load()}")
    t = case(2, 2, 1, 32, 8, torch.bfloat16, seed=3)
    t["slot_mapping"] = torch.tensor([0, t["k_pool"].shape[0] * t["k_pool"].shape[1]])
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_norm.norm_rotary_write(**t)


def test_fp32_attention_inputs_stay_on_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_norm, "_loaded", lambda: pytest.fail("the op was asked for fp32 rows"))
    t = case(2, 4, 2, 32, 8, torch.float32, seed=4)
    t = {name: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for name, x in t.items()}
    ref_q, ref_k, ref_v = run(attention.norm_rotary_write, t)
    got_q, got_k, got_v = run(cpu_norm.norm_rotary_write, t)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
