"""The SwiGLU activation for CPU (bf16 models): silu(gate) * up in one pass, ATen's bits.

What it is: one C++ op (built on first use with torch.utils.cpp_extension.load_inline, cached by torch like
cairn/ops/cpu_norm.py) that turns a bf16 [rows, 2 * inner] gate_up row ([gate | up]) into bf16(bf16(silu(gate)) *
up), what the reference (cairn/ops/activation.py) does in two ATen calls with a tensor between them (with the
chunk, three calls a layer and about 100 us of a decode step's CPU each, BENCHMARKS.md). On AVX-512 (16 lanes)
and on AVX2 + FMA (8 lanes; the widest the instruction path allows, cairn/ops/cpu_isa.py: `vector_body(path)`
says which) it computes the silu with libtorch's own vectorised exp, the one ATen's vectorised code calls on that
CPU, in ATen's formula (cairn/ops/cpu_vec.py), and rounds where ATen rounds, so it gives the reference's bits;
that is checked once when it loads, on every bf16 value (the silu's input is bf16: 65,536 cases), and where it
does not hold the reference is used (one log line). One exception, ATen's own: subnormal values follow the
subnormal mode of the thread that computes them (`torch.set_flush_denormal` sets it for the calling thread and
threads created later), and above one thread's grain ATen and this op split the work differently; so on
prefill-sized inputs a subnormal gate (|x| < 1.2e-38) may come out flushed in one and not the other. Decode rows run on
the calling thread in both: the same bits. An earlier scalar build of this op was slower than ATen's two
vectorised calls and was not kept (BENCHMARKS.md, fourth pass).

What it is not: for fp32 / fp16 models (the reference), nor the MoE experts' activations (their own loops).
`load()` returns the module, or a one-line reason why not.
"""

from __future__ import annotations

import functools
import logging

import torch

from cairn.ops import activation, cpu_isa
from cairn.ops.cpu_build import build_command, build_inline, built_or_why
from cairn.ops.cpu_vec import VEC_SOURCE

log = logging.getLogger(__name__)

NAME = "cairn_cpu_silu4"  # torch caches builds by name: a new source gets a new name

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

namespace {
""" + VEC_SOURCE + r"""
CAIRN_AVX512 void row_avx512(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t inner) {
  for (int64_t e = 0; e < inner; e += 16) {
    const int64_t n = std::min<int64_t>(16, inner - e);
    const __m512 s = round_bf16_ps(silu_ps(load_bf16_ps(gate + e, n)));
    store_bf16_ps(out + e, _mm512_mul_ps(s, load_bf16_ps(up + e, n)), n);
  }
}

CAIRN_AVX2 void row_avx2(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t inner) {
  for (int64_t e = 0; e < inner; e += 8) {
    const int64_t n = std::min<int64_t>(8, inner - e);
    const __m256 s = round_bf16_ps8(silu_ps8(load_bf16_ps8(gate + e, n)));
    store_bf16_ps8(out + e, _mm256_mul_ps(s, load_bf16_ps8(up + e, n)), n);
  }
}

void row_generic(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t inner) {
  for (int64_t e = 0; e < inner; ++e) {
    const float g = float(gate[e]);
    out[e] = c10::BFloat16(float(c10::BFloat16(g / (1.0f + std::exp(-g)))) * float(up[e]));
  }
}

}  // namespace

// The body silu_mul runs on this CPU up to `max_body` (2 AVX-512, 1 AVX2, 0 generic: the path's cap, cpu_isa.body):
// "avx512", "avx2" (with FMA) or "generic".
std::string vector_body(int64_t max_body) {
  if (max_body >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return "avx512";
  return max_body >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? "avx2" : "generic";
}

// gate_up [rows, 2 * inner] bf16 (each row contiguous; rows evenly spaced) -> silu(gate) * up [rows, inner] bf16,
// on the widest body up to max_body (vector_body)
torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t max_body) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.stride(1) == 1 &&
              gate_up.size(1) % 2 == 0, "silu_mul: gate_up [rows, 2 * inner] bf16, rows contiguous");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, inner}, gate_up.options());
  const auto* gp = gate_up.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const std::string body = vector_body(max_body);
  const auto row = body == "avx512" ? row_avx512 : body == "avx2" ? row_avx2 : row_generic;
  auto run = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) row(gp + i * stride, gp + i * stride + inner, op + i * inner, inner);
  };
  if (rows * inner <= 65536) run(0, rows);  // a decode step's rows: no parallel region
  else at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(inner, 1)), run);
  return out;
}
"""


@functools.cache  # one build (or one failure) per directory, per process
def load(build_dir: str | None = None):
    """The built module (`silu_mul`), or a one-line reason why not. Never raises."""
    return build_inline(NAME, _SOURCE, ["silu_mul", "vector_body"], "the fused silu * up op", build_dir,
                        ("-ffp-contract=off",))


def vector_body(path: str) -> str | None:
    """The body the op runs on this CPU on instruction path `path` (cpu_isa.PATHS): "avx512", "avx2" or "generic";
    None where it does not build."""
    library = load()
    return None if isinstance(library, str) else library.vector_body(cpu_isa.body(path))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are equal bit for bit, but for NaNs, which need only be NaN alike (their payloads may differ)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def gives_reference_bits(op) -> bool:
    """The op (gate_up -> silu(gate) * up) gives the reference's outputs for every bf16 gate value, against an up
    of 1 and a random one.

    Both run on this thread (slices of 16,384 gates: below ATen's parallel grain), since the threads of a
    process may differ in their subnormal mode: `torch.set_flush_denormal` (which the engine sets) changes the
    calling thread's and those created after it, not the worker threads already running."""
    gate = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.randn(gate.shape[0], generator=torch.Generator().manual_seed(0)).bfloat16()
    for u in (torch.ones_like(up), up):
        for g, v in zip(gate.split(SLICE), u.split(SLICE), strict=True):
            gate_up = torch.cat([g, v]).view(1, -1)
            if not same_bits(op(gate_up), activation.silu_mul(gate_up)):
                return False
    return True


SLICE = 16384  # gates per check call: one thread for ATen's elementwise ops (their grain is 32,768 elements)


@functools.cache  # loaded (or refused) once per process and path, and said so in one line
def _loaded(path: str):
    """The op on `path` as a call gate_up [rows, 2 * inner] -> [rows, inner], or None (the reference)."""
    library = load()
    if isinstance(library, str):
        log.warning("MLP silu(gate) * up: the reference (%s)", library)
        return None
    max_body, fn = cpu_isa.body(path), library.silu_mul

    def op(gate_up: torch.Tensor) -> torch.Tensor:
        return fn(gate_up, max_body)
    if not gives_reference_bits(op):
        log.warning("MLP silu(gate) * up: the reference (the fused op's %s body does not give ATen's bits on this "
                    "CPU)", vector_body(path))
        return None
    log.info("MLP silu(gate) * up: cairn's fused CPU op (ATen's bits; %s body)", vector_body(path))
    return op


def load_once(path: str) -> bool:
    """Load (build, or find in torch's cache) and check the op now, once per process; whether bf16 on CPU will
    run it on `path` (else the reference, said so in one line)."""
    return _loaded(path) is not None


def silu_mul(gate_up: torch.Tensor, path: str) -> torch.Tensor:
    """activation.silu_mul's contract and bits, through the C++ op on instruction path `path` (cpu_isa.PATHS) for
    bf16 on CPU (the reference otherwise, or when the op does not build or does not reproduce ATen's bits here).
    `Kernels.silu_mul` is a CpuOp that passes the path."""
    op = _loaded(path) if gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu" else None
    if op is None or gate_up.stride(-1) != 1:
        return activation.silu_mul(gate_up)
    if gate_up.dim() == 2:  # a decode step's rows, as they are (no reshape and view: ~1 us each)
        return op(gate_up)
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    return op(rows).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def bound_silu_mul(path: str):
    """silu_mul on `path` as one pre-bound call for a decode plan (cairn/model/decode_plan.py): the op itself,
    taking bf16 CPU gate_up rows [n, 2 * inner] with contiguous last dimension; None where silu_mul would take the
    reference (the op not loaded)."""
    return _loaded(path)


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_silu --build` (cpu_build.build_command)."""
    return build_command(argv, "cpu_silu", "fused silu * up op", lambda: built_or_why(load()))


if __name__ == "__main__":
    raise SystemExit(main())
