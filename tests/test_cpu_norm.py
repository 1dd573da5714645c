"""cairn's fused residual add + RMSNorm op (cairn/ops/cpu_norm.py) against the reference (cairn/ops/norm.py).

The op must give the reference's bits: the residual sum and the normed rows, zero-centred and plain
scales, widths that are and are not multiples of a CPU vector, one row (decode) and many (prefill),
rows that are a strided view (attention's q heads). In the engine, bf16 greedy decoding with the op
gives the same tokens and log-probabilities as with the reference (the attention layers' q / k norms, rotary
and KV writes too: csrc/norm_rotary.h), bit for bit, batched or alone. Its
dispatch: fp32 stays on the reference, and an op that does not build, or whose sums are not ATen's
here, leaves the reference in one log line.
"""

from __future__ import annotations

import pytest
import torch

from cairn import ops
from cairn.ops import attention, cpu_norm, norm
from tests.harness import bf16_decode_against_reference, failed_build, one_warning_line


def op():
    if cpu_norm._loaded() is None:
        pytest.skip(f"the fused norm op is not used here: {cpu_norm.load()}")
    return cpu_norm.add_rms_norm


def bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("rows, dim", [(1, 1024), (1, 64), (3, 100), (37, 256), (2, 5), (300, 48), (1, 4099)])
@pytest.mark.parametrize("zero_centred", [True, False])
@pytest.mark.parametrize("scale", [1.0, 40.0, 1e-3])
def test_add_and_norm_gives_the_reference_bits(rows, dim, zero_centred, scale):
    fused = op()
    x, delta = bf16(rows, dim, seed=dim, scale=scale), bf16(rows, dim, seed=dim + 1, scale=scale)
    weight = bf16(dim, seed=dim + 2, scale=0.3)
    ref_sum, ref_normed = norm.add_rms_norm(x, delta, weight, 1e-6, zero_centred)
    got_sum, got_normed = fused(x, delta, weight, 1e-6, zero_centred)
    assert same_bits(got_sum, ref_sum) and same_bits(got_normed, ref_normed)
    got_x, got_only = fused(x, None, weight, 1e-6, zero_centred)
    assert got_x is x and same_bits(got_only, norm.rms_norm(x, weight, 1e-6, zero_centred))


def test_norm_of_strided_head_rows_gives_the_reference_bits():
    """q heads as GatedAttention takes them: the first half of each [q | gate] row block, a strided view."""
    fused = op()
    q, _ = bf16(3, 4, 2 * 64, seed=5).view(3, 4, 2 * 64).chunk(2, dim=-1)
    weight = bf16(64, seed=6, scale=0.3)
    _, got = fused(q, None, weight, 1e-6, True)
    assert same_bits(got, norm.rms_norm(q, weight, 1e-6, True))


def test_inputs_are_not_modified():
    fused = op()
    x, delta, weight = bf16(4, 96, seed=1), bf16(4, 96, seed=2), bf16(96, seed=3)
    x0, d0 = x.clone(), delta.clone()
    fused(x, delta, weight, 1e-6, True)
    assert torch.equal(x, x0) and torch.equal(delta, d0)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_engine_decodes_bf16_with_the_fused_norm_bit_for_bit_like_the_reference(checkpoints, family):
    op()
    fused = {"add_rms_norm": ops.fused_add_rms_norm, "norm_rotary_write": ops.fused_norm_rotary_write}
    reference = {"add_rms_norm": norm.add_rms_norm, "norm_rotary_write": attention.norm_rotary_write}
    bf16_decode_against_reference(checkpoints[family][0], fused, reference, exact=True)


def test_fp32_stays_on_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_norm, "_loaded", lambda: pytest.fail("the op was asked for fp32 rows"))
    x, delta, weight = torch.randn(2, 16), torch.randn(2, 16), torch.randn(16)
    got = cpu_norm.add_rms_norm(x, delta, weight, 1e-6, True)
    ref = norm.add_rms_norm(x, delta, weight, 1e-6, True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("why", ["build", "sums"])
def test_op_falls_back_to_the_reference_in_one_line(caplog, monkeypatch, tmp_path, why):
    if why == "build":
        failed_build(cpu_norm, monkeypatch, tmp_path, "fused add + RMSNorm op")
    else:
        op()
        monkeypatch.setattr(cpu_norm, "CANDIDATE_LANES", (3,))  # no CPU's sum runs on 3-float vectors
    with one_warning_line(caplog, cpu_norm):
        x, weight = bf16(2, 32, seed=1), bf16(32, seed=2)
        for _ in range(2):
            assert same_bits(cpu_norm.add_rms_norm(x, x, weight, 1e-6, True)[1],
                             norm.add_rms_norm(x, x, weight, 1e-6, True)[1])

