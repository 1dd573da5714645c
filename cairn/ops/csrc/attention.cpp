// cairn's paged decode attention for CPU (bf16): one new query token per sequence over its context in the paged KV
// pool, each key and value read once, in its page, for all the query heads of its group; the library
// cairn/ops/cpu_attention.py builds and wraps (cairn/ops/attention.py: paged_decode_attention, its reference).
// Sequences split into parts of PART positions, combined in order: a sequence's output is the same bits whatever the
// threads and the batch. The AVX2 + FMA body uses vec.h's exp; the generic one std::exp. Compiled with
// -ffp-contract=off (cpu_attention.CPP).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {
#include "vec.h"

constexpr int64_t PART = 256;  // positions per task; fixed, so the order of sums never depends on the threads

// Where one call's tensors are, and their sizes.
struct Call {
  const at::BFloat16* q;       // [B, H, D]
  const at::BFloat16* k;       // [pages, page, KVH, D]
  const at::BFloat16* v;
  const int64_t* tables;       // [B, max_pages]
  const int64_t* lens;         // [B]
  float* ml;                   // [B, H, parts, 2]: m, l of each part
  float* acc;                  // [B, H, parts, D]: the part's weighted sum of values
  int64_t table_stride, page, kvh, heads, dim, group, parts;
  float scale;

  int64_t row(int64_t b, int64_t t, int64_t h) const {  // offset of position t's key / value for KV head h
    const int64_t p = tables[b * table_stride + t / page];
    return ((p * page + t % page) * kvh + h) * dim;
  }
  int64_t out_index(int64_t b, int64_t qh, int64_t part) const { return (b * heads + qh) * parts + part; }
};

CAIRN_AVX2 inline float hsum8(__m256 v) {  // a fixed order of sums
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// s[g][i] = (q_g . k_i) * scale for NG query heads g (fp32 rows of D in qf) and the part's n positions i (their
// keys at c.k + rows[i]): each key is read once for the NG heads.
template <int NG>
CAIRN_AVX2 void scores_avx2(const Call& c, const int64_t* rows, int64_t n, const float* qf, float* s,
                            int64_t s_stride) {
  const int64_t D = c.dim;
  for (int64_t i = 0; i < n; ++i) {
    const at::BFloat16* kp = c.k + rows[i];
    __m256 sum[NG];
    for (int g = 0; g < NG; ++g) sum[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 key = load_bf16_ps8(kp + d, 8);
      for (int g = 0; g < NG; ++g) sum[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), key, sum[g]);
    }
    for (int g = 0; g < NG; ++g) s[g * s_stride + i] = hsum8(sum[g]) * c.scale;
  }
}

// acc[g][:] = sum_i p[g][i] v_i for NG heads (values at c.v + rows[i]), 16 of the D values at a time (the sums
// stay in registers).
template <int NG>
CAIRN_AVX2 void values_avx2(const Call& c, const int64_t* rows, int64_t n, const float* p, int64_t p_stride,
                            float* acc) {
  const int64_t D = c.dim;
  for (int64_t d = 0; d < D; d += 16) {
    const bool two = d + 16 <= D;
    __m256 lo[NG], hi[NG];
    for (int g = 0; g < NG; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const at::BFloat16* vp = c.v + rows[i] + d;
      const __m256 a = load_bf16_ps8(vp, 8), z = two ? load_bf16_ps8(vp + 8, 8) : _mm256_setzero_ps();
      for (int g = 0; g < NG; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + g * p_stride + i);
        lo[g] = _mm256_fmadd_ps(w, a, lo[g]);
        hi[g] = _mm256_fmadd_ps(w, z, hi[g]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm256_storeu_ps(acc + g * D + d, lo[g]);
      if (two) _mm256_storeu_ps(acc + g * D + d + 8, hi[g]);
    }
  }
}

// f(heads, g) for the group's query heads four at a time from g (then what is left), `heads` a compile-time count.
template <typename F>
void by_fours(int64_t group, F&& f) {
  for (int64_t g = 0; g < group; g += 4) {
    switch (std::min<int64_t>(4, group - g)) {
      case 4: f(std::integral_constant<int, 4>{}, g); break;
      case 3: f(std::integral_constant<int, 3>{}, g); break;
      case 2: f(std::integral_constant<int, 2>{}, g); break;
      default: f(std::integral_constant<int, 1>{}, g);
    }
  }
}

// The scaled scores, max, sum and weighted values of one part: positions [t0, t1) of sequence b, KV head h.
CAIRN_AVX2 void part_avx2(const Call& c, int64_t b, int64_t h, int64_t t0, int64_t t1) {
  const int64_t D = c.dim, G = c.group, n = t1 - t0, padded = (n + 7) / 8 * 8;
  std::vector<float> qf(G * D), s(G * padded, -std::numeric_limits<float>::infinity()), acc(G * D);
  std::vector<int64_t> rows(n);  // where each position's key and value are (one table lookup per position)
  for (int64_t i = 0; i < n; ++i) rows[i] = c.row(b, t0 + i, h);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = float(c.q[(b * c.heads + h * G + g) * D + d]);
  by_fours(G, [&](auto heads, int64_t g) {
    scores_avx2<decltype(heads)::value>(c, rows.data(), n, &qf[g * D], &s[g * padded], padded);
  });
  for (int64_t g = 0; g < G; ++g) {
    float* sg = &s[g * padded];
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    __m256 l = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) {  // the padding is -inf: exp gives 0
      const __m256 p = exp_ps8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), _mm256_set1_ps(m)));
      _mm256_storeu_ps(sg + i, p);
      l = _mm256_add_ps(l, p);
    }
    float* ml = c.ml + 2 * c.out_index(b, h * G + g, t0 / PART);
    ml[0] = m;
    ml[1] = hsum8(l);
  }
  by_fours(G, [&](auto heads, int64_t g) {
    values_avx2<decltype(heads)::value>(c, rows.data(), n, &s[g * padded], padded, &acc[g * D]);
  });
  for (int64_t g = 0; g < G; ++g)
    std::memcpy(c.acc + c.out_index(b, h * G + g, t0 / PART) * D, &acc[g * D], D * sizeof(float));
}

void part_generic(const Call& c, int64_t b, int64_t h, int64_t t0, int64_t t1) {
  const int64_t D = c.dim, G = c.group, n = t1 - t0;
  std::vector<float> s(G * n), acc(G * D, 0.0f);
  for (int64_t t = t0; t < t1; ++t) {
    const at::BFloat16* kp = c.k + c.row(b, t, h);
    for (int64_t g = 0; g < G; ++g) {
      const at::BFloat16* qp = c.q + (b * c.heads + h * G + g) * D;
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += float(qp[d]) * float(kp[d]);
      s[g * n + t - t0] = dot * c.scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float m = -std::numeric_limits<float>::infinity(), total = 0.0f;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, s[g * n + i]);
    for (int64_t i = 0; i < n; ++i) total += (s[g * n + i] = std::exp(s[g * n + i] - m));
    float* ml = c.ml + 2 * c.out_index(b, h * G + g, t0 / PART);
    ml[0] = m;
    ml[1] = total;
  }
  for (int64_t t = t0; t < t1; ++t) {
    const at::BFloat16* vp = c.v + c.row(b, t, h);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += s[g * n + t - t0] * float(vp[d]);
  }
  for (int64_t g = 0; g < G; ++g)
    std::memcpy(c.acc + c.out_index(b, h * G + g, t0 / PART) * D, &acc[g * D], D * sizeof(float));
}

// out[b, qh] from its parts, in order: sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p.
void combine(const Call& c, int64_t b, int64_t qh, at::BFloat16* out) {
  const int64_t parts = (c.lens[b] + PART - 1) / PART, D = c.dim;
  float big = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < parts; ++p) big = std::max(big, c.ml[2 * c.out_index(b, qh, p)]);
  std::vector<float> sum(D, 0.0f);
  float total = 0.0f;
  for (int64_t p = 0; p < parts; ++p) {
    const float* ml = c.ml + 2 * c.out_index(b, qh, p);
    const float w = std::exp(ml[0] - big);  // 1 for the part holding the largest score
    const float* acc = c.acc + c.out_index(b, qh, p) * D;
    total += w * ml[1];
    for (int64_t d = 0; d < D; ++d) sum[d] += w * acc[d];
  }
  for (int64_t d = 0; d < D; ++d) out[(b * c.heads + qh) * D + d] = c10::BFloat16(sum[d] / total);
}

// Whether heads of `dim` run the AVX2 body, up to `max_body` (0: generic only; 1 or more: AVX2 where the CPU has it)
bool avx2_body(int64_t dim, int64_t max_body) {
  return max_body >= 1 && dim % 8 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

// The body paged_decode runs on this CPU for heads of `dim`, up to max_body: "avx2" (with FMA) or "generic".
std::string vector_body(int64_t dim, int64_t max_body) { return avx2_body(dim, max_body) ? "avx2" : "generic"; }

// q [B, H, D] bf16; k_pool, v_pool [pages, page_size, KVH, D] bf16 contiguous; page_tables [B, max_pages] and
// context_lens [B] int64 (each >= 1, and its pages in the table) -> [B, H, D] bf16.
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& page_tables, const torch::Tensor& context_lens, double scale,
                           int64_t max_body) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "paged_decode: shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_pool.scalar_type() == at::kBFloat16 &&
              v_pool.scalar_type() == at::kBFloat16, "paged_decode: bf16 q and pools");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_decode: contiguous");
  TORCH_CHECK(page_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              page_tables.is_contiguous() && context_lens.is_contiguous(), "paged_decode: int64 tables and lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D && KVH > 0 && H % KVH == 0, "paged_decode: heads and head size");
  TORCH_CHECK(page_tables.size(0) == B && context_lens.size(0) == B, "paged_decode: one table and length per row");
  auto out = torch::empty_like(q);
  if (B == 0) return out;
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t longest = 0;
  const int64_t* tables = page_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= page_tables.size(1) * k_pool.size(1), "paged_decode: context length");
    longest = std::max(longest, lens[b]);
    for (int64_t i = 0; i < (lens[b] + k_pool.size(1) - 1) / k_pool.size(1); ++i) {
      const int64_t p = tables[b * page_tables.size(1) + i];
      TORCH_CHECK(p >= 0 && p < k_pool.size(0), "paged_decode: page id ", p, " outside the pool");
    }
  }
  const int64_t parts = (longest + PART - 1) / PART;
  auto ml = torch::empty({B, H, parts, 2}, q.options().dtype(at::kFloat));
  auto acc = torch::empty({B, H, parts, D}, q.options().dtype(at::kFloat));
  const Call c{q.data_ptr<at::BFloat16>(), k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(),
               tables, lens, ml.data_ptr<float>(), acc.data_ptr<float>(),
               page_tables.size(1), k_pool.size(1), KVH, H, D, H / KVH, parts, float(scale)};
  const auto part = avx2_body(D, max_body) ? part_avx2 : part_generic;
  at::parallel_for(0, B * KVH * parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / (KVH * parts), h = i / parts % KVH, t0 = i % parts * PART;
      if (t0 < lens[b]) part(c, b, h, t0, std::min(t0 + PART, lens[b]));
    }
  });
  auto* op = out.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < B * H; ++i) combine(c, i / H, i % H, op);
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("vector_body", torch::wrap_pybind_function(vector_body), "vector_body");
}
