"""The causal-conv1d adapter (cairn/ops/cuda_conv.py) on CPU, against the reference conv kernels.

No GPU here, and the package has no CPU build: `stand_in_conv_fn` / `stand_in_conv_update` are CPU
STAND-INS with causal-conv1d's published signatures and behaviour (channel-last input required with an
initial state, the output in the input's layout, the decode state updated where it lies), computed with
F.conv1d. What these tests check is the adapter's reshaping, state and capture logic, and that both
layers (Gated DeltaNet, Mamba2) run right with it; that the real kernels match is for a GPU run
(benchmarks/gpu_check.py).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from cairn.engine.llm import LLM
from cairn.ops import REFERENCE, conv, cuda_conv, mamba2, optional, select_kernels
from cairn.request.sampling_params import SamplingParams


def stand_in_conv_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal_conv1d_fn: x [B, C, T], weight [C, K], initial_states [B, C, K-1] -> out [B, C, T], x's layout;
    with the checks of the package's C++ for a channel-last call with an initial state."""
    assert seq_idx is None and not return_final_states and activation == "silu"
    assert initial_states is None or x.stride(1) == 1, "initial_states is only supported for channel last layout"
    if x.stride(1) == 1:
        assert x.shape[1] % 8 == 0 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0
    assert initial_states is None or initial_states.stride(1) == 1
    assert bias is None or bias.dtype == weight.dtype
    width = weight.shape[1]
    full = torch.cat([initial_states.float(), x.float()], dim=-1) if initial_states is not None else \
        F.pad(x.float(), (width - 1, 0))
    y = F.silu(F.conv1d(full, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=x.shape[1]))
    out = torch.empty_like(x)  # keeps x's strides, as the kernel writes in x's layout
    out.copy_(y)
    return out


def stand_in_conv_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """causal_conv1d_update: x [B, C], conv_state [B, C, K-1] updated in place -> out [B, C]."""
    assert activation == "silu" and cache_seqlens is None and conv_state_indices is None
    window = torch.cat([conv_state.float(), x.float().unsqueeze(-1)], dim=-1)
    y = (window * weight.float()).sum(-1) + (0 if bias is None else bias.float())
    conv_state.copy_(window[..., 1:])
    return F.silu(y).to(x.dtype)


@pytest.fixture
def fake_conv(monkeypatch):
    module = types.ModuleType("causal_conv1d")
    module.causal_conv1d_fn, module.causal_conv1d_update = stand_in_conv_fn, stand_in_conv_update
    monkeypatch.setitem(sys.modules, "causal_conv1d", module)
    return module


def conv_inputs(tokens: int, channels: int = 24, kernel: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, channels, generator=gen), torch.randn(channels, kernel - 1, generator=gen),
            torch.randn(channels, kernel, generator=gen), torch.randn(channels, generator=gen))


@pytest.mark.parametrize("tokens", [2, 3, 37])  # shorter than K-1, exactly K-1, longer
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_prefill_adapter_matches_the_reference_with_captures(fake_conv, tokens, with_bias):
    x, state, weight, bias = conv_inputs(tokens)
    bias = bias if with_bias else None
    counts = sorted({1, min(2, tokens), tokens})
    got_caps, ref_caps = ([torch.empty_like(state) for _ in counts] for _ in range(2))
    fast = cuda_conv.make_prefill(fake_conv.causal_conv1d_fn)
    out, final = fast(x, state.clone(), weight, list(zip(counts, got_caps, strict=True)), bias=bias)
    ref_out, ref_final = conv.causal_conv1d(x, state, weight, list(zip(counts, ref_caps, strict=True)), bias=bias)
    assert out.shape == ref_out.shape and final.shape == ref_final.shape
    assert (out - ref_out).abs().max().item() < 1e-5
    assert torch.equal(final, ref_final)  # states are copies of inputs: exact
    for got, ref in zip(got_caps, ref_caps, strict=True):
        assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="outside"):
        fast(x, state, weight, [(tokens + 1, got_caps[0])])


def test_conv_prefill_adapter_takes_the_reference_for_channels_the_kernel_refuses(fake_conv):
    x, state, weight, _ = conv_inputs(9, channels=20)  # not a multiple of 8
    out, final = cuda_conv.make_prefill(fake_conv.causal_conv1d_fn)(x, state, weight)
    ref_out, ref_final = conv.causal_conv1d(x, state, weight)
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)


def test_mamba_conv_prefill_adapter_takes_the_bias_in_mamba_order(fake_conv):
    x, state, weight, bias = conv_inputs(20, seed=3)
    cap, ref_cap = torch.empty_like(state), torch.empty_like(state)
    out, final = cuda_conv.make_mamba_prefill(fake_conv.causal_conv1d_fn)(x, state, weight, bias, [(7, cap)])
    ref_out, ref_final = mamba2.mamba_conv1d(x, state, weight, bias, [(7, ref_cap)])
    assert (out - ref_out).abs().max().item() < 1e-5
    assert torch.equal(final, ref_final) and torch.equal(cap, ref_cap)


def test_conv_update_adapter_updates_the_state_where_it_lies(fake_conv):
    gen = torch.Generator().manual_seed(1)
    pool, x, weight = torch.randn(5, 24, 3, generator=gen), torch.randn(3, 24, generator=gen), torch.randn(24, 4)
    bias = torch.randn(24, generator=gen)
    ref_out, ref_state = conv.causal_conv1d_update(x, pool[1:4].clone(), weight, bias)
    view = pool[1:4]
    out, returned = cuda_conv.make_update(fake_conv.causal_conv1d_update)(x, view, weight, bias)
    assert returned is view  # no copy: the pool's slots are the state
    assert torch.equal(pool[1:4], ref_state)
    assert (out - ref_out).abs().max().item() < 1e-5


def test_conv_update_adapter_copies_a_state_it_cannot_update_in_place(fake_conv):
    gen = torch.Generator().manual_seed(2)
    state, x, weight = torch.randn(3, 3, 24, generator=gen).transpose(1, 2), torch.randn(3, 24), torch.randn(24, 4)
    before = state.clone()
    out, returned = cuda_conv.make_update(fake_conv.causal_conv1d_update)(x, state, weight)
    ref_out, ref_state = conv.causal_conv1d_update(x, before, weight)
    assert torch.equal(state, before) and torch.equal(returned, ref_state)
    assert (out - ref_out).abs().max().item() < 1e-5


def test_absent_or_broken_causal_conv1d_falls_back_to_the_reference(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # import raises ImportError
    assert cuda_conv.kernels() == {}
    monkeypatch.delitem(sys.modules, "causal_conv1d")

    def broken(name):
        raise OSError("undefined symbol: built against another torch")  # what a mismatched CUDA extension raises

    monkeypatch.setattr(optional.importlib, "import_module", broken)
    with caplog.at_level("INFO", logger="cairn.ops.optional"):
        assert cuda_conv.kernels() == {}
    assert "causal-conv1d unavailable" in caplog.text


def test_fast_kernels_take_the_conv_adapter_on_cuda(fake_conv, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    chosen = select_kernels("cuda", fast=True)
    assert chosen.name == "cuda[causal-conv1d]"
    assert chosen.causal_conv1d_update is chosen.mamba_conv1d_update is not REFERENCE.causal_conv1d_update
    assert chosen.chunk_gated_delta_rule is REFERENCE.chunk_gated_delta_rule


def greedy(llm: LLM, prompts: list[list[int]], tokens: int = 6) -> list[tuple[list[int], torch.Tensor]]:
    """Tokens and their log-probabilities per prompt, the prompts together (decode steps batched), each
    prefilled from scratch (no prefix cache)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=True, cache_prompt=False)
    return [(c.token_ids, torch.tensor(c.logprobs)) for c in llm.generate(prompts, params)]


def assert_same_generations(got, expected) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        assert (logprobs - ref_logprobs).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])  # Gated DeltaNet, Mamba2
def test_models_with_the_conv_adapter_generate_what_the_reference_generates(fake_conv, tmp_path, family):
    from tests.checkpoints import write_checkpoint

    write_checkpoint(family, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01)
    prompts = [list(range(3, 40)), list(range(50, 52))]  # a prefill longer than the conv, one shorter
    expected = greedy(llm, prompts)
    llm.engine.model.kernels = dataclasses.replace(REFERENCE, name="stand-in", **cuda_conv.kernels())
    assert_same_generations(greedy(llm, prompts), expected)
