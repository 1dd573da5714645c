"""A fused residual add + RMSNorm for CPU (bf16 models): x + delta and rms_norm(x + delta) in one pass.

What it is: one C++ op (built on first use with torch.utils.cpp_extension.load_inline, cached by torch
like cairn/ops/cpu_gdn.py) that does per row of a bf16 [..., D] tensor what the reference does in
about ten ATen calls (cairn/ops/norm.py: the bf16 add, then float, pow, mean, add eps, rsqrt, two
products and the cast back), with no intermediate tensors (rows spread over the torch threads when
there are many: prefill).

It rounds exactly where the reference does (the sum to bf16 once, the normed product to bf16 once) and
sums the squares in the order ATen's float sum takes over a contiguous row (its cascade of four
accumulator rows of CPU vectors; the vector width is found at load by comparing with torch's own sum:
8 floats on this Xeon although torch reports AVX512), so its outputs are the reference's bit for bit
(tests/test_cpu_norm.py) and the residual stream is the same whichever path a row takes. Where no width
reproduces ATen's sum, the reference is used (one log line).

What it is not: an fp32 / fp16 kernel (those keep the reference), nor the gated norm of Gated DeltaNet
(inside cpu_gdn's op). `load()` returns the module, or a one-line reason why not, and the model then
keeps the reference with one log line.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from cairn.ops import attention, norm
from cairn.ops.cpu_build import build_command, build_inline, built_or_why
from cairn.ops.cpu_norm_rotary import NORM_ROTARY_SOURCE

log = logging.getLogger(__name__)

NAME = "cairn_cpu_norm2"  # torch caches builds by name: a new source gets a new name

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

// one row: res = bf16(x + d) when d is given (else x), out = bf16((res / rms(res)) * scale), where
// scale = 1 + w (zero-centred) or w, in fp32; W is the weight's element type (bf16 or float)
template <typename W>
void norm_row(const at::BFloat16* x, const at::BFloat16* d, at::BFloat16* res, at::BFloat16* out, const W* w,
              bool zero_centred, int64_t D, float eps, int64_t lanes, float* buf) {
  float *xf = buf, *sq = buf + D;
  for (int64_t i = 0; i < D; ++i) {
    float v = float(x[i]);
    if (d) { const c10::BFloat16 r(v + float(d[i])); res[i] = r; v = float(r); }
    xf[i] = v;
    sq[i] = v * v;
  }
  const float r = 1.0f / std::sqrt(aten_row_sum(sq, D, lanes) / float(D) + eps);
  for (int64_t i = 0; i < D; ++i) {
    const float scale = zero_centred ? 1.0f + float(w[i]) : float(w[i]);
    out[i] = c10::BFloat16((xf[i] * r) * scale);
  }
}

// rows of x [..., D]: D contiguous, rows evenly spaced (a strided view of heads is fine); their spacing
int64_t row_stride(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "rows must be contiguous");
  for (int64_t i = 0; i + 2 < x.dim(); ++i)
    TORCH_CHECK(x.size(i) == 1 || x.stride(i) == x.stride(i + 1) * x.size(i + 1), "rows must be evenly spaced");
  return x.dim() >= 2 ? x.stride(-2) : x.size(-1);
}

void run(const torch::Tensor& x, const torch::Tensor* d, torch::Tensor* res, torch::Tensor& out,
         const torch::Tensor& weight, double eps, bool zero_centred, int64_t lanes) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: x bf16");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
              (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat), "rms_norm: weight [D]");
  TORCH_CHECK(lanes >= 1 && lanes <= kMaxLanes, "rms_norm: lanes");
  if (d) TORCH_CHECK(d->sizes() == x.sizes() && d->scalar_type() == at::kBFloat16, "rms_norm: delta like x");
  const int64_t D = x.size(-1), N = D ? x.numel() / D : 0;
  const int64_t xs = row_stride(x), ds = d ? row_stride(*d) : 0;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* dp = d ? d->data_ptr<at::BFloat16>() : nullptr;
  auto* rp = res ? res->data_ptr<at::BFloat16>() : nullptr;
  auto* op = out.data_ptr<at::BFloat16>();
  const bool bf16_weight = weight.scalar_type() == at::kBFloat16;
  const void* wp = weight.data_ptr();
  auto rows = [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(2 * D);
    for (int64_t i = lo; i < hi; ++i) {
      const at::BFloat16* di = dp ? dp + i * ds : nullptr;
      at::BFloat16* ri = rp ? rp + i * D : nullptr;
      if (bf16_weight)
        norm_row(xp + i * xs, di, ri, op + i * D, static_cast<const at::BFloat16*>(wp), zero_centred, D, float(eps),
                 lanes, buf.data());
      else
        norm_row(xp + i * xs, di, ri, op + i * D, static_cast<const float*>(wp), zero_centred, D, float(eps), lanes,
                 buf.data());
    }
  };
  if (N * D <= 16384) rows(0, N);  // a decode step's rows: no parallel region
  else at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), rows);
}

}  // namespace

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
""" + NORM_ROTARY_SOURCE


@functools.cache  # one build (or one failure) per directory, per process
def load(build_dir: str | None = None):
    """The built module (`rms_norm`, `add_rms_norm`, `row_sums`, `norm_rotary_write`), or a one-line reason why
    not. Never raises."""
    functions = ["rms_norm", "add_rms_norm", "row_sums", "norm_rotary_write"]
    return build_inline(NAME, _SOURCE, functions, "the fused add + RMSNorm op", build_dir, ("-ffp-contract=off",))


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


@dataclass(frozen=True)
class _Op:
    library: object  # the built module
    lanes: int  # its sums' vector width, the one that reproduces ATen's


@functools.cache  # loaded (or refused) once per process, and said so in one line
def _loaded() -> _Op | None:
    library = load()
    if isinstance(library, str):
        log.warning("RMSNorm: the reference (%s)", library)
        return None
    lanes = find_lanes(library)
    if lanes is None:
        log.warning("RMSNorm: the reference (the fused op's sums are not ATen's bit for bit on this CPU)")
        return None
    log.info("RMSNorm: cairn's fused CPU op (residual add + norm in one pass; ATen's sum order, %d lanes)", lanes)
    return _Op(library, lanes)


def load_once() -> bool:
    """Load (build, or find in torch's cache) and check the op now, once per process; whether bf16 on CPU will
    run it (else the reference, said so in one line)."""
    return _loaded() is not None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """norm.add_rms_norm's contract and bits, through the C++ op for bf16 on CPU (the reference otherwise,
    or when the op does not build or cannot reproduce ATen's sum here). x and delta are [..., D] with
    contiguous, evenly spaced rows (a strided view of heads is fine); the results are new contiguous tensors."""
    op = _loaded() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
    if op is None:
        return norm.add_rms_norm(x, delta, weight, eps, zero_centred)
    if delta is None:
        return x, op.library.rms_norm(x, weight, eps, zero_centred, op.lanes)
    return op.library.add_rms_norm(x, delta, weight, eps, zero_centred, op.lanes)


def bound_add_rms_norm(weight: torch.Tensor, eps: float, zero_centred: bool):
    """add_rms_norm of this norm's weight as one pre-bound call, `(x, delta | None) -> (x + delta, normed)` on
    bf16 CPU rows as add_rms_norm takes them, for a decode plan (cairn/model/decode_plan.py); None where
    add_rms_norm would take the reference (not bf16 on CPU, the op not loaded). The same op and arguments as
    add_rms_norm's: the same bits."""
    op = _loaded() if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" else None
    if op is None:
        return None
    add, norm_only, lanes = op.library.add_rms_norm, op.library.rms_norm, op.lanes

    def call(x: torch.Tensor, delta: torch.Tensor | None):
        if delta is None:
            return x, norm_only(x, weight, eps, zero_centred, lanes)
        return add(x, delta, weight, eps, zero_centred, lanes)
    return call


def norm_rotary_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, zero_centred: bool, cos: torch.Tensor, sin: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """attention.norm_rotary_write's contract and bits, through one C++ op for bf16 on CPU
    (cairn/ops/cpu_norm_rotary.py; the reference otherwise, or when the op does not build or cannot
    reproduce ATen's sum here)."""
    op = _loaded() if q.dtype == torch.bfloat16 and q.device.type == "cpu" else None
    if op is None or q_weight.dtype != k_weight.dtype:
        return attention.norm_rotary_write(q, k, v, q_weight, k_weight, eps, zero_centred, cos, sin, k_pool, v_pool,
                                           slot_mapping)
    return op.library.norm_rotary_write(q, k, v, q_weight, k_weight, eps, zero_centred, cos, sin, k_pool, v_pool,
                                        slot_mapping, op.lanes)


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_norm --build` (cpu_build.build_command)."""
    return build_command(argv, "cpu_norm", "fused add + RMSNorm op", lambda: built_or_why(load()))


if __name__ == "__main__":
    raise SystemExit(main())
