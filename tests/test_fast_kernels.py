"""Dispatch of the optional CUDA kernels (cairn/ops/cuda.py), on CPU.

No GPU here: these check the choice (off by default, reference when the package is absent or the
device is not CUDA) and the adapters' contracts, with a CPU stand-in that has flash-linear-attention's
signature and computes the rule token by token. That the real kernels match is for a GPU run.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cairn.engine.llm import LLM
from cairn.ops import REFERENCE, cuda, gdn, select_kernels
from cairn.request.sampling_params import SamplingParams


def stand_in_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """fla's (q, k, v: [B, T, H, D]; g, beta: [B, T, H]; state [B, H, K, V]) computed token by token."""
    assert use_qk_l2norm_in_kernel and output_final_state and scale == q.shape[-1] ** -0.5
    state = initial_state.clone()
    out = []
    for t in range(q.shape[1]):
        o, state = gdn.recurrent_gated_delta_rule(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        out.append(o)
    return torch.stack(out, dim=1), state


@pytest.fixture
def fake_fla(monkeypatch):
    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = stand_in_fla
    module.fused_recurrent_gated_delta_rule = stand_in_fla
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    return module


def inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(tokens, 4, 8, generator=gen)
    g, beta = -torch.rand(tokens, 4, generator=gen), torch.rand(tokens, 4, generator=gen)
    return q, k, v, g, beta, torch.randn(4, 16, 8, generator=gen)


@pytest.fixture
def no_other_libraries(monkeypatch):
    """causal-conv1d and flashinfer absent (import raises ImportError), whatever this machine has."""
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)


def test_fast_kernels_are_off_by_default_and_cuda_only(fake_fla, no_other_libraries):
    assert select_kernels("cuda") is REFERENCE
    assert select_kernels("cpu", fast=True) is REFERENCE
    chosen = select_kernels("cuda", fast=True)
    assert chosen.name == "cuda[fla]"
    assert chosen.causal_conv1d is REFERENCE.causal_conv1d  # the reference stands in for what is absent


def test_absent_package_falls_back_to_the_reference(monkeypatch, no_other_libraries):
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # import raises ImportError
    assert cuda.load_fla() is None
    assert select_kernels("cuda", fast=True) is REFERENCE


def test_chunk_adapter_splits_at_captures_and_matches_the_reference(fake_fla):
    q, k, v, g, beta, state = inputs(50)
    fast = cuda.make_chunk(fake_fla.chunk_gated_delta_rule)
    got_caps, ref_caps = [torch.empty_like(state) for _ in range(3)], [torch.empty_like(state) for _ in range(3)]
    counts = (1, 17, 50)
    out, final = fast(q, k, v, g, beta, state, list(zip(counts, got_caps, strict=True)))
    ref_out, ref_final = gdn.chunk_gated_delta_rule(q, k, v, g, beta, state, list(zip(counts, ref_caps, strict=True)))
    assert (out - ref_out).abs().max().item() < 1e-4
    assert (final - ref_final).abs().max().item() < 1e-4
    for got, ref in zip(got_caps, ref_caps, strict=True):
        assert (got - ref).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="outside"):
        fast(q, k, v, g, beta, state, [(51, got_caps[0])])


def test_recurrent_adapter_updates_the_state_where_it_lies(fake_fla):
    q, k, v, g, beta, _ = inputs(3, seed=1)  # a batch of three sequences, one token each
    pool = torch.randn(5, 4, 16, 8)
    view = pool[1:4]
    expected_out, expected = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, view.clone())
    out, returned = cuda.make_recurrent(fake_fla.fused_recurrent_gated_delta_rule)(q, k, v, g, beta, view)
    assert returned is view
    assert (pool[1:4] - expected).abs().max().item() < 1e-5
    assert (out - expected_out).abs().max().item() < 1e-5


def test_fast_kernels_flag_on_cpu_runs_the_reference():
    llm = LLM(dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01, fast_kernels=True)
    assert llm.engine.model.kernels is REFERENCE
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids) == 3
