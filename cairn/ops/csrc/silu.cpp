// cairn's SwiGLU activation for CPU (bf16): silu(gate) * up in one pass, ATen's bits; the library
// cairn/ops/cpu_silu.py builds, checks against its reference (cairn/ops/activation.py) on every bf16 value, and wraps.
// Rows run on the widest body the path allows (vector_body: AVX-512, AVX2 + FMA or generic), the silus with
// libtorch's vectorised exp (vec.h). Compiled with -ffp-contract=off (cpu_silu.CPP).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

namespace {
#include "vec.h"

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
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("vector_body", torch::wrap_pybind_function(vector_body), "vector_body");
}
