// cairn's bf16 gemv for CPU decode, y = x W^T for up to 16 rows of x, the library cairn/ops/cpu_gemv.py builds and
// wraps (GemvKernel; F.linear is its reference). Its paths, how each walks the weight and why an output's bits do
// not depend on the rows, tiles or threads are told in cpu_gemv.py's docstring and beside each below.
//
// One translation unit: the AVX512-BF16 path here, then gemv_avx2.h (the AVX2 + FMA paths, row-major and packed)
// and gemv_amx.h (the AMX-BF16 path) included inside this file's anonymous namespace, then the streaming read and
// the entry points gemv / gemv_packed / gemv_int8_packed, which take the path by name (`isa`).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <atomic>
#include <cpuid.h>
#include <cstring>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 16;

// ---- AVX512-BF16: R weight rows side by side, M x rows per pass --------------------------------------
// One core reads a weight from memory only as fast as it keeps enough cache-line fills in flight; R
// streams side by side plus a software prefetch kPrefetch bytes ahead in each keep more in flight than
// the hardware prefetcher alone (which also stops at every 4 KiB page). Measured with
// benchmarks/gemv_step_bench.py: 16 rows and 256 bytes read a decode step's weights 1.3-1.5x faster than 4
// rows without prefetch. A prefetch past the end of a row lands in the next row (or past the weight:
// prefetches never fault).
constexpr int64_t kPrefetch = 256;

template <int R, int M>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void tile_avx512(const uint16_t* w, int64_t k, const uint16_t* x, int64_t x_stride, float* out, int64_t out_stride) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t full = k / 32;
  for (int64_t c = 0; c < full; ++c) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * x_stride + c * 32);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * k + c * 32) + kPrefetch, _MM_HINT_T0);
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * k + c * 32);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  if (k % 32) {
    const __mmask32 mask = (__mmask32)((1ull << (k % 32)) - 1);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + full * 32);
    for (int r = 0; r < R; ++r) {
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + full * 32);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[m * out_stride + r] = _mm512_reduce_add_ps(acc[r][m]);
}

#include "gemv_avx2.h"

#include "gemv_amx.h"

// ---- a plain streaming read, to measure the memory bandwidth beside torch's `sum` --------------------
__attribute__((target("avx512f")))
int64_t read_lines_avx512(const char* p, int64_t lines) {
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 4 <= lines; i += 4) {
    const char* q = p + i * 64;
    s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(q));
    s1 = _mm512_add_epi64(s1, _mm512_loadu_si512(q + 64));
    s2 = _mm512_add_epi64(s2, _mm512_loadu_si512(q + 128));
    s3 = _mm512_add_epi64(s3, _mm512_loadu_si512(q + 192));
  }
  for (; i < lines; ++i) s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(p + i * 64));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
}

__attribute__((target("avx2")))
int64_t read_lines_avx2(const char* p, int64_t lines) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 2 <= lines; i += 2) {
    const char* q = p + i * 64;
    s0 = _mm256_add_epi64(s0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    s1 = _mm256_add_epi64(s1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
    s2 = _mm256_add_epi64(s2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64)));
    s3 = _mm256_add_epi64(s3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 96)));
  }
  for (; i < lines; ++i) {
    s0 = _mm256_add_epi64(s0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 64)));
    s1 = _mm256_add_epi64(s1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 64 + 32)));
  }
  alignas(32) int64_t lanes[4];
  const __m256i sum = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

int64_t read_lines_scalar(const char* p, int64_t lines) {
  int64_t s = 0;
  for (int64_t i = 0; i < lines * 8; ++i) {
    int64_t v;
    std::memcpy(&v, p + i * 8, 8);
    s += v;
  }
  return s;
}

}  // namespace

std::string best_isa() {
  return has_amx_bf16() ? "amx_bf16" : has_avx512_bf16() ? "avx512_bf16" : has_avx2() ? "avx2" : "";
}

// Reads every whole 64-byte line of `buf` once (threads split it in contiguous halves) and returns a
// checksum, so nothing is optimised away: the memory bandwidth as a simple loop of vector loads sees it.
int64_t stream_read(const torch::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous(), "stream_read: a contiguous tensor");
  const char* p = static_cast<const char*>(buf.data_ptr());
  const int64_t lines = buf.numel() * buf.element_size() / 64;
  const auto read = __builtin_cpu_supports("avx512f") ? read_lines_avx512
                    : __builtin_cpu_supports("avx2") ? read_lines_avx2 : read_lines_scalar;
  std::atomic<int64_t> total{0};
  at::parallel_for(0, lines, 4096, [&](int64_t a, int64_t b) { total += read(p + a * 64, b - a); });
  return total.load();
}

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv: bf16 only");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "gemv: rows of x and w must be contiguous");
  TORCH_CHECK(x.size(0) <= kMaxRows, "gemv: at most ", kMaxRows, " rows of x");
  if (isa == "amx_bf16") {
    TORCH_CHECK(has_amx_bf16(), "gemv: this CPU (or its kernel) lacks amx_bf16");
    return gemv_amx(x, w);
  }
  if (isa == "avx2") {
    TORCH_CHECK(has_avx2(), "gemv: this CPU lacks avx2");
    return gemv_avx2(x, w);
  }
  TORCH_CHECK(isa == "avx512_bf16", "gemv: unknown path ", isa);
  const int64_t m_rows = x.size(0), n = w.size(0), k = w.size(1), x_stride = x.stride(0);
  const Plan p = plan_avx512(std::max<int64_t>(m_rows, 1));
  TORCH_CHECK(p.rows > 0, "gemv: this CPU lacks ", isa);
  auto y = torch::empty({m_rows, n}, x.options());
  if (m_rows == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t tiles = (n + p.rows - 1) / p.rows;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, k * p.rows * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    float acc[kMaxRows * 4];  // [m_rows, p.rows]: m_rows * p.rows <= 64 (16 x 1, 8 x 2, 4 x up to 16)
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * p.rows, rows = std::min<int64_t>(p.rows, n - n0);
      if (rows == p.rows) {
        run_tile(p, true, wp + n0 * k, k, xp, x_stride, m_rows, acc, p.rows);
      } else {
        for (int64_t r = 0; r < rows; ++r)
          run_tile(p, false, wp + (n0 + r) * k, k, xp, x_stride, m_rows, acc + r, p.rows);
      }
      for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t r = 0; r < rows; ++r) yp[m * n + n0 + r] = c10::BFloat16(acc[m * p.rows + r]);
    }
  });
  return y;
}
// y [M, n] = x [M, K] against a packed weight [ceil(n / 16), K, 16] of format F (times its output rows' scales
// where `scales` is given); any number of rows of x. `nb` / `mt` force a tile (0: packed_plan's), for the
// benchmark that picks them.
template <class F>
torch::Tensor packed_walk(const char* name, const torch::Tensor& x, const torch::Tensor& packed, at::ScalarType wtype,
                          const c10::BFloat16* scales, int64_t n, int64_t nb, int64_t mt) {
  TORCH_CHECK(has_avx2(), name, ": this CPU lacks avx2");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kBlock && x.size(1) == packed.size(1),
              name, ": x [M, K] and a packed weight [blocks, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == wtype, name, ": x bf16, the weight ", wtype);
  TORCH_CHECK(x.stride(1) == 1 && packed.is_contiguous(), name, ": rows of x and the packed weight contiguous");
  TORCH_CHECK(n > (packed.size(0) - 1) * kBlock && n <= packed.size(0) * kBlock, name, ": n does not fit the blocks");
  const int64_t m_rows = x.size(0), k = x.size(1), blocks = packed.size(0);
  auto y = torch::empty({m_rows, n}, x.options());
  if (m_rows == 0 || n == 0) return y;
  auto [plan_nb, plan_mt] = packed_plan(m_rows);
  if (nb > 0 && mt > 0) {
    TORCH_CHECK(packed_tile_for<F>(int(nb), int(mt)) != nullptr, name, ": no tile ", nb, " x ", mt);
    plan_nb = int(nb);
    plan_mt = int(mt);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = static_cast<const typename F::T*>(packed.data_ptr());
  auto* yp = y.data_ptr<at::BFloat16>();
  std::vector<float> xt(std::max<int64_t>(1, m_rows * k));
  widen_transposed(xp, x.stride(0), m_rows, k, xt.data());
  const int64_t block_stride = k * kBlock, units = (blocks + plan_nb - 1) / plan_nb;
  const int64_t grain = std::max<int64_t>(
      1, (int64_t(1) << 16) / std::max<int64_t>(1, block_stride * plan_nb * int64_t(sizeof(typename F::T))));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b0 = u * plan_nb, here = std::min<int64_t>(plan_nb, blocks - b0);
      // a last unit of fewer blocks runs them one at a time: the same chains, so the same bits
      for (int64_t b = b0; b < b0 + here; b += (here == plan_nb ? here : 1)) {
        const int width = here == plan_nb ? plan_nb : 1;
        const int64_t valid = std::min<int64_t>(n - b * kBlock, width * kBlock);
        for (int64_t m0 = 0; m0 < m_rows; m0 += plan_mt) {
          const int mm = int(std::min<int64_t>(plan_mt, m_rows - m0));
          packed_tile_for<F>(width, mm)(wp + b * block_stride, block_stride, k, xt.data() + m0, m_rows,
                                        scales ? scales + b * kBlock : nullptr, yp + m0 * n + b * kBlock, n, valid);
        }
      }
    }
  });
  return y;
}

torch::Tensor gemv_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t nb, int64_t mt) {
  return packed_walk<Bf16Block>("gemv_packed", x, packed, at::kBFloat16, nullptr, n, nb, mt);
}

// The int8 weight-only form: `pack_int8` of q [n, K] int8, y = (x q^T) * scales, scales [n] bf16, each output's
// sum one sequential fp32 chain over k as in gemv_packed, times its scale, rounded to bf16 once.
torch::Tensor gemv_int8_packed(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                               int64_t n, int64_t nb, int64_t mt) {
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.is_contiguous() &&
              scales.scalar_type() == at::kBFloat16, "gemv_int8_packed: scales [n] bf16, contiguous");
  return packed_walk<Int8Block>("gemv_int8_packed", x, packed, at::kChar, scales.data_ptr<at::BFloat16>(), n, nb, mt);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", torch::wrap_pybind_function(gemv), "gemv");
  m.def("gemv_packed", torch::wrap_pybind_function(gemv_packed), "gemv_packed");
  m.def("gemv_int8_packed", torch::wrap_pybind_function(gemv_int8_packed), "gemv_int8_packed");
  m.def("best_isa", torch::wrap_pybind_function(best_isa), "best_isa");
  m.def("stream_read", torch::wrap_pybind_function(stream_read), "stream_read");
}
