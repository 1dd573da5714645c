"""cairn's fused SwiGLU activation (cairn/ops/cpu_silu.py) against the reference (cairn/ops/activation.py).

The op must give the reference's bits (ATen's silu, then the product): on every bf16 gate value, on decode
rows and prefill rows, widths that are and are not multiples of 16, and strided rows. In the engine, bf16
greedy decoding with it gives the same tokens and log-probabilities as with the reference, bit for bit,
batched or alone. Its dispatch: fp32 stays on the reference, and an op that does not build, or whose bits
are not ATen's here, leaves the reference in one log line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cairn import ops
from cairn.ops import activation, cpu_silu
from tests.cpu_paths import COMPILED, FLAGS
from tests.harness import bf16_decode_against_reference, failed_build, one_warning_line

per_path = pytest.mark.parametrize("path", COMPILED)


def library(path: str):
    """The op on `path` (gate_up -> silu(gate) * up), as bf16 decode runs it there."""
    got = cpu_silu._loaded(path)
    if got is None:
        pytest.skip(f"the fused silu * up op is not used here: {cpu_silu.load()}")
    return got


def bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@per_path
def test_every_bf16_gate_value_gives_the_reference_bits(path):
    assert cpu_silu.gives_reference_bits(library(path))
    gate = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = gate[gate.isfinite()]
    gate_up = torch.cat([finite, bf16(finite.shape[0], seed=3, scale=4.0)]).view(1, -1)
    got, ref = cpu_silu.silu_mul(gate_up, path), activation.silu_mul(gate_up)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@per_path
@pytest.mark.parametrize("shape", [(1, 2 * 3584), (1, 2 * 100), (5, 2 * 37), (300, 2 * 48), (2, 3, 2 * 24)])
def test_rows_give_the_reference_bits(shape, path):
    library(path)
    gate_up = bf16(*shape, seed=sum(shape), scale=3.0)
    got = cpu_silu.silu_mul(gate_up, path)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(got.view(torch.int16), activation.silu_mul(gate_up).view(torch.int16))


@per_path
def test_strided_rows_give_the_reference_bits(path):
    library(path)
    wide = bf16(4, 2 * 64 + 10, seed=7)
    gate_up = wide[:, 5:5 + 2 * 64]  # rows 138 apart, each contiguous
    assert torch.equal(cpu_silu.silu_mul(gate_up, path).view(torch.int16),
                       activation.silu_mul(gate_up).view(torch.int16))


@per_path
def test_engine_decodes_bf16_with_the_fused_silu_bit_for_bit_like_the_reference(checkpoints, path):
    library(path)
    bf16_decode_against_reference(checkpoints["qwen3_5"][0], {"silu_mul": ops.CpuOp(cpu_silu.silu_mul, path)},
                                  {"silu_mul": activation.silu_mul}, exact=True, cpu_isa=path)


def test_fp32_stays_on_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_silu, "_loaded", lambda path: pytest.fail("the op was asked for fp32 rows"))
    gate_up = torch.randn(2, 32)
    assert torch.equal(cpu_silu.silu_mul(gate_up, "avx2"), activation.silu_mul(gate_up))


@pytest.mark.parametrize("why", ["build", "bits"])
def test_op_falls_back_to_the_reference_in_one_line(caplog, monkeypatch, tmp_path, why):
    if why == "build":
        failed_build(cpu_silu, monkeypatch, tmp_path, "fused silu * up op")
    else:  # an op one bit off the reference on one output: the real check at load time finds it
        real = cpu_silu.load()
        if isinstance(real, str):
            pytest.skip(f"the fused silu * up op does not build here: {real}")

        class OneBitOff:
            def silu_mul(self, gate_up, max_body):
                out = real.silu_mul(gate_up, max_body)
                out.view(torch.int16)[0, 0] ^= 1
                return out

            def vector_body(self, max_body):
                return real.vector_body(max_body)

        monkeypatch.setattr(cpu_silu, "load", lambda: OneBitOff())
    with one_warning_line(caplog, cpu_silu):
        gate_up = bf16(2, 64, seed=1)
        for _ in range(2):
            assert torch.equal(cpu_silu.silu_mul(gate_up, "avx2").view(torch.int16),
                               activation.silu_mul(gate_up).view(torch.int16))


@per_path
def test_op_runs_the_widest_body_its_path_allows(path):
    """The op is compiled for AVX-512, AVX2 + FMA and baseline x86-64; a path runs the widest it allows on this CPU,
    so the bit checks above ran each body this CPU has (AVX2, with libtorch's 8-wide exp, forced on an AVX-512
    CPU too)."""
    library(path)
    wide = path in ("avx512_bf16", "amx_bf16") and {"avx512f", "avx512bw"} <= FLAGS
    assert cpu_silu.vector_body(path) == ("avx512" if wide else "avx2")


@pytest.mark.skipif(not COMPILED, reason="the op does not build here (no compiler)")
def test_op_is_kept_when_the_engine_flushes_subnormals_after_worker_threads_started():
    """The engine sets flush-to-zero on its thread (torch.set_flush_denormal) when torch's worker threads may
    already run without it: the load check must still find ATen's bits (it once compared the op with ATen's work
    split over threads in both modes and refused the op in every engine). A fresh process, to start the workers
    before the flag is set."""
    library(COMPILED[-1])
    script = ("import torch\n"
              "torch.set_num_threads(2)\n"
              "torch.ones(1 << 20).bfloat16().sum()  # worker threads start without flush-to-zero\n"
              "torch.set_flush_denormal(True)\n"
              "from cairn.ops import cpu_silu\n"
              f"print(cpu_silu._loaded({COMPILED[-1]!r}) is not None)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
