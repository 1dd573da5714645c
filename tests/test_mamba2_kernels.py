"""The Mamba2 reference kernels against a per-token recurrence written out here in float64: the chunked
SSD scan (outputs and final states), its state captures inside a segment, the batched recurrent step,
and the biased causal conv with its streaming state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cairn.ops.mamba2 import mamba_conv1d, mamba_conv1d_update, ssd_chunk_scan, ssd_recurrent_step

H, P, N = 4, 8, 16  # heads, head_dim, state_size
LIMIT = (0.05, 2.0)  # tight enough that the random dt below is clamped at both ends


def scan_inputs(seq_len: int, groups: int = 2, seed: int = 0, batch: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, seq_len, H, P, generator=g)
    dt = 2 * torch.randn(*batch, seq_len, H, generator=g)
    B = torch.randn(*batch, seq_len, groups, N, generator=g)
    C = torch.randn(*batch, seq_len, groups, N, generator=g)
    A = -(0.5 + 1.5 * torch.rand(H, generator=g))
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g)
    state = torch.randn(*batch, H, P, N, generator=g)
    return x, dt, A, B, C, D, dt_bias, state


def naive_scan(x, dt, A, B, C, D, dt_bias, state, dt_limit):
    """The recurrence one token at a time, in float64: (y [T, H, P], final state [H, P, N])."""
    x, dt, A, B, C, D, dt_bias, state = (t.double() for t in (x, dt, A, B, C, D, dt_bias, state))
    steps = F.softplus(dt + dt_bias).clamp(*dt_limit)
    per_group = x.shape[1] // B.shape[1]
    ys = []
    for t in range(x.shape[0]):
        b, c = B[t].repeat_interleave(per_group, 0), C[t].repeat_interleave(per_group, 0)  # [H, N]
        decay = (steps[t] * A).exp()[:, None, None]
        state = decay * state + (steps[t, :, None] * x[t])[:, :, None] * b[:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, c) + D[:, None] * x[t])
    return torch.stack(ys), state


def assert_near(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4):
    scale = 1.0 + expected.abs().max().item()
    assert (got.double() - expected.double()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("chunk_size", [16, 64, 128])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_scan_equals_the_per_token_recurrence(seq_len, chunk_size, with_state):
    x, dt, A, B, C, D, dt_bias, state = scan_inputs(seq_len)
    if not with_state:
        state = torch.zeros_like(state)
    y, final = ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, state, chunk_size, LIMIT)
    y_ref, final_ref = naive_scan(x, dt, A, B, C, D, dt_bias, state, LIMIT)
    assert y.dtype == x.dtype and final.dtype == torch.float32
    assert_near(y, y_ref)
    assert_near(final, final_ref)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_chunked_scan_maps_each_head_to_its_group(groups):
    x, dt, A, B, C, D, dt_bias, state = scan_inputs(40, groups=groups, seed=groups)
    y, final = ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, state, 16)
    y_ref, final_ref = naive_scan(x, dt, A, B, C, D, dt_bias, state, (0.0, float("inf")))
    assert_near(y, y_ref)
    assert_near(final, final_ref)


def test_chunked_scan_leaves_the_initial_state_unmodified():
    x, dt, A, B, C, D, dt_bias, state = scan_inputs(20)
    before = state.clone()
    ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, state, 8)
    assert torch.equal(state, before)


COUNTS = [1, 5, 63, 64, 65, 100, 128, 129, 150]


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_ssm_states_captured_inside_a_segment_equal_running_it_that_far(chunk_size):
    seq_len = COUNTS[-1]
    x, dt, A, B, C, D, dt_bias, state = scan_inputs(seq_len, seed=3)
    captured = [torch.full_like(state, float("nan")) for _ in COUNTS]
    pairs = list(zip(COUNTS, captured, strict=True))
    y, final = ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, state, chunk_size, LIMIT, pairs)
    for count, got in pairs:
        _, expected = ssd_chunk_scan(
            x[:count], dt[:count], A, B[:count], C[:count], D, dt_bias, state, chunk_size, LIMIT)
        assert_near(got, expected, 1e-5)
    plain_y, plain_final = ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, state, chunk_size, LIMIT)
    assert torch.equal(y, plain_y) and torch.equal(final, plain_final)


def test_ssm_capture_outside_the_segment_is_refused():
    x, dt, A, B, C, D, dt_bias, state = scan_inputs(10)
    for bad in (0, 11):
        with pytest.raises(ValueError, match="outside the segment"):
            ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, state, 4, capture_at=[(bad, torch.empty_like(state))])


def test_recurrent_steps_equal_the_chunked_scan_and_update_the_pool_rows_in_place():
    seq_len, batch = 70, 2
    x, dt, A, B, C, D, dt_bias, states = scan_inputs(seq_len, seed=5, batch=(batch,))
    pool = torch.zeros(batch + 2, H, P, N)
    pool[1:3] = states
    rows = pool[1:3]  # a view: the step must update the pool where it lies
    ys = []
    for t in range(seq_len):
        y, _ = ssd_recurrent_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], D, dt_bias, rows, LIMIT)
        ys.append(y)
    ys = torch.stack(ys, dim=1)
    for i in range(batch):
        y_ref, final_ref = ssd_chunk_scan(x[i], dt[i], A, B[i], C[i], D, dt_bias, states[i], 32, LIMIT)
        assert_near(ys[i], y_ref)
        assert_near(pool[1 + i], final_ref)
    assert torch.equal(pool[0], torch.zeros(H, P, N)) and torch.equal(pool[3], torch.zeros(H, P, N))


CONV_C, K = 24, 4


def conv_inputs(seq_len: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(seq_len, CONV_C, generator=g), torch.randn(CONV_C, K - 1, generator=g),
            torch.randn(CONV_C, K, generator=g), torch.randn(CONV_C, generator=g))


def test_conv_equals_a_biased_depthwise_conv1d_over_state_and_input():
    x, state, weight, bias = conv_inputs(30)
    out, new_state = mamba_conv1d(x, state, weight, bias)
    full = torch.cat([state, x.T], dim=1)[None]  # [1, C, K-1+T]
    expected = F.silu(F.conv1d(full, weight[:, None], bias, groups=CONV_C))[0].T
    assert_near(out, expected, 1e-6)
    assert torch.equal(new_state, full[0, :, -(K - 1):])


def test_conv_update_steps_equal_the_prefill_conv():
    x, state, weight, bias = conv_inputs(12)
    out, final = mamba_conv1d(x, state, weight, bias)
    rolling = state[None].clone()
    for t in range(x.shape[0]):
        step, rolling = mamba_conv1d_update(x[t:t + 1], rolling, weight, bias)
        assert_near(step[0], out[t], 1e-6)
    assert torch.equal(rolling[0], final)


def test_conv_states_captured_inside_a_segment_equal_running_it_that_far():
    x, state, weight, bias = conv_inputs(COUNTS[-1])
    captured = [torch.full_like(state, float("nan")) for _ in COUNTS]
    mamba_conv1d(x, state, weight, bias, list(zip(COUNTS, captured, strict=True)))
    for count, got in zip(COUNTS, captured, strict=True):
        assert torch.equal(got, mamba_conv1d(x[:count], state, weight, bias)[1]), count
