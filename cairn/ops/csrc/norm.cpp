// cairn's fused residual add + RMSNorm for CPU (bf16), the library cairn/ops/cpu_norm.py builds and wraps
// (cairn/ops/norm.py holds the reference it reproduces bit for bit).
//
// rms_norm / add_rms_norm take rows of x [..., D] and round exactly where the reference does (the sum to bf16
// once, the normed product to bf16 once); the sum of squares follows ATen's float sum over a contiguous row
// (aten_row_sum: its cascade of four accumulator rows of `lanes`-wide vectors, the width cpu_norm.find_lanes finds
// at load by comparing with torch's own sum: row_sums). The attention layer's input op, norm_rotary_write, is in
// norm_rotary.h, included at the end: it uses norm_row. Compiled with -ffp-contract=off (cpu_norm.CPP).

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

#include "norm_rotary.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("row_sums", torch::wrap_pybind_function(row_sums), "row_sums");
  m.def("norm_rotary_write", torch::wrap_pybind_function(norm_rotary_write), "norm_rotary_write");
}
