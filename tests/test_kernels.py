"""The reference prefill kernels return the state at any position inside a segment, exactly as if the
segment had been split there (which is what lets a snapshot be taken without splitting a chunk)."""

from __future__ import annotations

import pytest
import torch

from cairn.ops.conv import causal_conv1d
from cairn.ops.gdn import chunk_gated_delta_rule

T, HK, HV, DK, DV, C, K = 150, 2, 4, 16, 8, 24, 4
COUNTS = [1, 5, 63, 64, 65, 100, 128, 149, 150]


def gdn_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, HK, DK, generator=g), torch.randn(T, HK, DK, generator=g)
    v = torch.randn(T, HV, DV, generator=g)
    decay = -torch.rand(T, HV, generator=g)
    beta = torch.rand(T, HV, generator=g)
    state = torch.randn(HV, DK, DV, generator=g)
    return q, k, v, decay, beta, state


def test_gdn_states_captured_inside_a_segment_equal_splitting_it_there():
    q, k, v, decay, beta, state = gdn_inputs()
    captured = [torch.full_like(state, float("nan")) for _ in COUNTS]
    out, final = chunk_gated_delta_rule(q, k, v, decay, beta, state, list(zip(COUNTS, captured, strict=True)))
    for count, got in zip(COUNTS, captured, strict=True):
        _, expected = chunk_gated_delta_rule(q[:count], k[:count], v[:count], decay[:count], beta[:count], state)
        assert (got - expected).abs().max().item() < 1e-4, count
    plain_out, plain_final = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    assert torch.equal(out, plain_out) and torch.equal(final, plain_final)


def test_conv_states_captured_inside_a_segment_equal_splitting_it_there():
    g = torch.Generator().manual_seed(1)
    x, state = torch.randn(T, C, generator=g), torch.randn(C, K - 1, generator=g)
    weight = torch.randn(C, K, generator=g)
    captured = [torch.full_like(state, float("nan")) for _ in COUNTS]
    causal_conv1d(x, state, weight, list(zip(COUNTS, captured, strict=True)))
    for count, got in zip(COUNTS, captured, strict=True):
        _, expected = causal_conv1d(x[:count], state, weight)
        assert torch.equal(got, expected), count


def test_gdn_capture_outside_the_segment_is_refused():
    q, k, v, decay, beta, state = gdn_inputs()
    for bad in (0, T + 1):
        with pytest.raises(ValueError, match="outside the segment"):
            chunk_gated_delta_rule(q, k, v, decay, beta, state, [(bad, torch.empty_like(state))])
