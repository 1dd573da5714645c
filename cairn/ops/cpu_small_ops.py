"""Small fused ops for CPU (bf16 models): the residual add + RMSNorm, and SwiGLU's silu(gate) * up.

What it is: C++ ops, x + delta and rms_norm(x + delta) in one pass, silu(gate) * up in one pass (built
on first use with torch.utils.cpp_extension.load_inline, cached by torch like cairn/ops/cpu_gdn.py).
The norm does per row of a bf16 [rows, D] tensor what the reference does in
about ten ATen calls (cairn/ops/norm.py: the bf16 add, then float, pow, mean, add eps, rsqrt, two
products and the cast back), rows spread over the torch threads, with no intermediate tensors.

It rounds exactly where the reference does (the sum to bf16 once, the normed product to bf16 once) and
sums the squares in the order ATen's float sum takes over a contiguous row (its cascade of four
accumulator rows of CPU vectors; the vector width is found at load by comparing with torch's own sum,
8 floats on this Xeon although torch reports AVX512), so its outputs are the reference's bit for bit
(tests/test_cpu_small_ops.py): the residual stream is the same whichever path a row takes. Where no width
reproduces ATen's sum, the reference is used (one log line). silu_mul rounds silu to bf16, then the
product, as `F.silu(gate) * up` does; its exp is the C library's, and it is used only when it gives
ATen's silu for every finite bf16 input (checked at load: 2^16 values).

What it is not: an fp32 / fp16 kernel (those keep the reference), nor the gated norm of Gated DeltaNet
(inside cpu_gdn's op). `load()` returns the module, or a one-line reason why not, and the model then
keeps the references with one log line.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from cairn.ops import norm, swiglu

log = logging.getLogger(__name__)

NAME = "cairn_cpu_small_ops"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kLevels = 4, kRows = 4, kMaxLanes = 16;

int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = uint64_t(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

// sum of v[0, n) in the order of ATen's cascade_sum over a contiguous row: `lanes`-wide vectors in four
// accumulator rows, cascaded in levels of 2^power vectors, folded row into row, then lane by lane after the
// scalar tail (rows shorter than one vector: the same cascade over single floats).
float aten_row_sum(const float* v, int64_t n, int64_t lanes) {
  const int64_t w = n >= lanes ? lanes : 1;
  const int64_t vecs = n / w, size = vecs / kRows;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels), step = int64_t(1) << power;
  const int64_t mask = step - 1;
  float acc[kLevels][kRows][kMaxLanes] = {};
  auto add = [&](float* dst, int64_t vec) { for (int64_t l = 0; l < w; ++l) dst[l] += v[vec * w + l]; };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < kRows; ++k) add(acc[0][k], i * kRows + k);
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kRows; ++k)
        for (int64_t l = 0; l < w; ++l) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.0f; }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < kRows; ++k) add(acc[0][k], i * kRows + k);
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kRows; ++k)
      for (int64_t l = 0; l < w; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t t = size * kRows; t < vecs; ++t) add(acc[0][0], t);
  for (int64_t k = 1; k < kRows; ++k)
    for (int64_t l = 0; l < w; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.0f;
  for (int64_t t = vecs * w; t < n; ++t) total += v[t];
  for (int64_t l = 0; l < w; ++l) total += acc[0][0][l];
  return total;
}

// one row: res = bf16(x + d) when d is given (else x), out = bf16((res / rms(res)) * scale)
void norm_row(const at::BFloat16* x, const at::BFloat16* d, at::BFloat16* res, at::BFloat16* out,
              const float* scale, int64_t D, float eps, int64_t lanes, float* buf) {
  float *xf = buf, *sq = buf + D;
  for (int64_t i = 0; i < D; ++i) {
    float v = float(x[i]);
    if (d) { const c10::BFloat16 r(v + float(d[i])); res[i] = r; v = float(r); }
    xf[i] = v;
    sq[i] = v * v;
  }
  const float r = 1.0f / std::sqrt(aten_row_sum(sq, D, lanes) / float(D) + eps);
  for (int64_t i = 0; i < D; ++i) out[i] = c10::BFloat16((xf[i] * r) * scale[i]);
}

std::vector<float> scales(const torch::Tensor& weight, bool zero_centred) {
  const auto w = weight.to(at::kFloat).contiguous();
  std::vector<float> s(w.data_ptr<float>(), w.data_ptr<float>() + w.numel());
  if (zero_centred) for (float& v : s) v = 1.0f + v;
  return s;
}

void run(const torch::Tensor& x, const torch::Tensor* d, torch::Tensor* res, torch::Tensor& out,
         const torch::Tensor& weight, double eps, bool zero_centred, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "rms_norm: x [rows, D] bf16 with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: weight [D]");
  TORCH_CHECK(lanes >= 1 && lanes <= kMaxLanes, "rms_norm: lanes");
  if (d) TORCH_CHECK(d->sizes() == x.sizes() && d->scalar_type() == at::kBFloat16 && d->stride(1) == 1,
                     "rms_norm: delta like x");
  const int64_t N = x.size(0), D = x.size(1);
  const std::vector<float> s = scales(weight, zero_centred);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* dp = d ? d->data_ptr<at::BFloat16>() : nullptr;
  auto* rp = res ? res->data_ptr<at::BFloat16>() : nullptr;
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t xs = x.stride(0), ds = d ? d->stride(0) : 0;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(2 * D);
    for (int64_t i = lo; i < hi; ++i)
      norm_row(xp + i * xs, dp ? dp + i * ds : nullptr, rp ? rp + i * D : nullptr, op + i * D, s.data(), D,
               float(eps), lanes, buf.data());
  });
}

}  // namespace

// silu(gate) * up of bf16 [rows, D] halves (rows may be strided, e.g. the two halves of gate_up's output):
// silu in fp32 rounded to bf16, then the product rounded to bf16, as F.silu(gate) * up does. [rows, D].
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == at::kBFloat16 &&
              up.scalar_type() == at::kBFloat16 && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_mul: gate and up [rows, D] bf16 with contiguous rows");
  const int64_t N = gate.size(0), D = gate.size(1);
  auto out = torch::empty({N, D}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  const auto* gp = gate.data_ptr<at::BFloat16>();
  const auto* up_ = up.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N * D, 16384, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r = i / D, c = i % D;
      const float g = float(gp[r * gate.stride(0) + c]);
      const float act = float(c10::BFloat16(g / (1.0f + std::exp(-g))));
      op[i] = c10::BFloat16(act * float(up_[r * up.stride(0) + c]));
    }
  });
  return out;
}

// the sum of each row of a float [rows, n] tensor in aten_row_sum's order (to find the lanes ATen's sum uses)
torch::Tensor row_sums(const torch::Tensor& rows, int64_t lanes) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous() && lanes >= 1 &&
              lanes <= kMaxLanes, "row_sums: contiguous float [rows, n], 1 to 16 lanes");
  auto out = torch::empty({rows.size(0)}, rows.options());
  for (int64_t i = 0; i < rows.size(0); ++i)
    out.data_ptr<float>()[i] = aten_row_sum(rows.data_ptr<float>() + i * rows.size(1), rows.size(1), lanes);
  return out;
}

// rms_norm(x) of each row of x [rows, D] (bf16, rows may be strided), weight [D] (bf16 or fp32): [rows, D].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool zero_centred,
                       int64_t lanes) {
  auto out = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  run(x, nullptr, nullptr, out, weight, eps, zero_centred, lanes);
  return out;
}

// (x + delta, rms_norm(x + delta)), both new [rows, D] bf16 tensors.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                        const torch::Tensor& weight, double eps, bool zero_centred, int64_t lanes) {
  auto res = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  auto out = torch::empty_like(res);
  run(x, &delta, &res, out, weight, eps, zero_centred, lanes);
  return {res, out};
}
"""


@functools.cache  # one build (or one failure) per directory, per process
def load(build_dir: str | None = None):
    """The built module (`rms_norm`, `add_rms_norm`, `silu_mul`, `row_sums`), or a one-line reason why not.
    Never raises."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(NAME, cpp_sources=_SOURCE, functions=["rms_norm", "add_rms_norm", "row_sums", "silu_mul"],
                           build_directory=build_dir, extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build: the reference it is
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return f"building the small CPU ops failed ({type(e).__name__}: {first[:200]})"


CANDIDATE_LANES = (8, 16, 4)  # floats per vector of ATen's CPU sum: AVX2, AVX-512, 128-bit builds


def find_lanes(library) -> int | None:
    """The vector width for which the op's sum of squares is ATen's float sum bit for bit, on rows of
    several lengths (the order depends on how ATen's kernels were built for this CPU), or None."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(16, n, generator=gen).bfloat16().float().pow(2) for n in (5, 20, 100, 256, 1024, 4099)]
    for lanes in dict.fromkeys(CANDIDATE_LANES):
        if all(torch.equal(library.row_sums(r, lanes), r.sum(-1)) for r in rows):
            return lanes
    return None


def silu_matches(library) -> bool:
    """Whether the op's silu(gate) * up is ATen's bit for bit for every finite bf16 gate (all 2^16 patterns
    but the non-finite ones: ATen's vector exp and the C library's may differ in a last float bit)."""
    gate = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate[gate.isfinite()].reshape(1, -1)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    got, want = library.silu_mul(gate, up), swiglu.silu_mul(gate, up)
    return torch.equal(got.view(torch.int16), want.view(torch.int16))


@dataclass(frozen=True)
class _Ops:
    library: object  # the built module
    lanes: int | None  # its sums' vector width, the one that reproduces ATen's; None: the norm keeps the reference
    silu: bool  # its silu_mul is ATen's bit for bit; False: the reference


@functools.cache  # loaded (or refused) once per process, and said so in one line
def _loaded() -> _Ops | None:
    library = load()
    if isinstance(library, str):
        log.warning("small CPU ops (add + RMSNorm, silu x up): the reference (%s)", library)
        return None
    ops = _Ops(library, find_lanes(library), silu_matches(library))
    norm_says = (f"fused (ATen's sum order, {ops.lanes} lanes)" if ops.lanes
                 else "the reference (the op's sums are not ATen's bit for bit here)")
    silu_says = "fused" if ops.silu else "the reference (the op's silu is not ATen's bit for bit here)"
    level = logging.INFO if ops.lanes and ops.silu else logging.WARNING
    log.log(level, "small CPU ops: add + RMSNorm %s; silu x up %s", norm_says, silu_says)
    return ops


def _ops_for(x: torch.Tensor) -> _Ops | None:
    return _loaded() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """norm.add_rms_norm's contract and bits, through the C++ op for bf16 on CPU (the reference otherwise,
    or when the op does not build or cannot reproduce ATen's sum here). x and delta are [..., D]; rows
    that are not evenly spaced views are copied first."""
    ops = _ops_for(x)
    if ops is None or ops.lanes is None:
        return norm.add_rms_norm(x, delta, weight, eps, zero_centred)
    rows = x.reshape(-1, x.shape[-1])  # a view whenever the rows are evenly spaced
    if delta is None:
        return x, ops.library.rms_norm(rows, weight, eps, zero_centred, ops.lanes).view(x.shape)
    res, out = ops.library.add_rms_norm(rows, delta.reshape(rows.shape), weight, eps, zero_centred, ops.lanes)
    return res.view(x.shape), out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """norm.rms_norm, the same way (add_rms_norm without a delta)."""
    return add_rms_norm(x, None, weight, eps, zero_centred)[1]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """swiglu.silu_mul's bits, through the C++ op for bf16 on CPU where it reproduces ATen's silu (the
    reference otherwise). gate and up are [..., D] halves, e.g. the two chunks of gate_up's output."""
    ops = _ops_for(gate)
    if ops is None or not ops.silu:
        return swiglu.silu_mul(gate, up)
    rows = gate.reshape(-1, gate.shape[-1])
    return ops.library.silu_mul(rows, up.reshape(rows.shape)).view(gate.shape)


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_small_ops --build`: build (or find in torch's cache) the ops."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cairn.ops.cpu_small_ops",
                                     description="Build cairn's small CPU ops.")
    parser.add_argument("--build", action="store_true", required=True, help="build it now (or find it built)")
    parser.parse_args(argv)
    library = load()
    built = f"none ({library})" if isinstance(library, str) else "built"
    print(f"cairn small CPU ops (add + RMSNorm, silu x up): {built}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
