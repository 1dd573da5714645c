// cairn's fused Gated DeltaNet decode step for CPU (bf16): conv update, gating, delta rule and gated norm of a batch
// of decode tokens in one parallel region; the library cairn/ops/cpu_gdn.py builds and wraps (cairn/ops/gdn.py holds
// the reference kernels, which it matches within bf16 rounding). How it rounds and what each body computes is told
// in cpu_gdn.py's docstring and beside each function below; the vector helpers are vec.h's.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {
#include "vec.h"


inline float bf(float v) { return float(c10::BFloat16(v)); }  // one rounding to bf16
inline float silu(float v) { return v / (1.0f + std::exp(-v)); }
inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

// The conv update of channels [c0, c1) of one sequence: the taps summed in order, each product rounded to bf16 like
// the reference's, the sum too (into acc); shifts the state.
inline void conv_taps(const at::BFloat16* x, at::BFloat16* state, int64_t state_stride_c, const at::BFloat16* w,
                      int64_t kernel, int64_t c0, int64_t c1, float* acc) {
  for (int64_t c = c0; c < c1; ++c) {
    at::BFloat16* s = state + c * state_stride_c;
    const at::BFloat16* wc = w + c * kernel;
    float a = 0.0f;
    for (int64_t j = 0; j + 1 < kernel; ++j) a += bf(float(s[j]) * float(wc[j]));
    a += bf(float(x[c]) * float(wc[kernel - 1]));
    acc[c - c0] = bf(a);
    for (int64_t j = 0; j + 2 < kernel; ++j) s[j] = s[j + 1];
    s[kernel - 2] = x[c];
  }
}

// silu(conv) of channels [c0, c1) rounded to bf16 like the reference (into out[c0, c1)). The silu of a bf16 value
// rounded to bf16 is the same whichever exp computes it (std::exp, or ATen's vectorised one on AVX-512: checked on
// all 65,536 bf16 values, tests/test_cpu_silu.py), so both paths give the same bits.
void conv_generic(const at::BFloat16* x, at::BFloat16* state, int64_t sc, const at::BFloat16* w, int64_t kernel,
                  int64_t c0, int64_t c1, float* out) {
  conv_taps(x, state, sc, w, kernel, c0, c1, out + c0);
  for (int64_t c = c0; c < c1; ++c) out[c] = bf(silu(out[c]));
}

CAIRN_AVX512 void conv_avx512(const at::BFloat16* x, at::BFloat16* state, int64_t sc, const at::BFloat16* w,
                              int64_t kernel, int64_t c0, int64_t c1, float* out) {
  for (int64_t b = c0; b < c1; b += 16) {
    const int64_t n = std::min<int64_t>(16, c1 - b);
    alignas(64) float acc[16];
    conv_taps(x, state, sc, w, kernel, b, b + n, acc);
    const __m512 v = round_bf16_ps(silu_ps(_mm512_maskz_loadu_ps(first_lanes(n), acc)));
    _mm512_mask_storeu_ps(out + b, first_lanes(n), v);
  }
}

// conv_taps for the 8 channels [c0, c0 + 8) of a 4-tap conv whose state is contiguous ([C, 3]: the Qwen hybrids'),
// a lane per channel, the same roundings and order; returns the 8 sums (rounded to bf16). The scalar form spends
// most of its time in the five roundings per channel, each with its NaN test: about a third of the op's time.
// Taps come tap-major out of channel-major memory: the weights [8, 4] by a 4 x 4 transpose in each 128-bit lane,
// the states [8, 3] by permutes and blends (stride 3), all loads within the 8 channels' own bytes.
CAIRN_AVX2 __m256 conv4_block8(const at::BFloat16* x, at::BFloat16* state, const at::BFloat16* w, int64_t c0) {
  const auto* wp = reinterpret_cast<const __m256i*>(w + c0 * 4);
  const __m256i wa = _mm256_loadu_si256(wp), wb = _mm256_loadu_si256(wp + 1);  // channels 0-3, 4-7
  const __m256 w01 = widen_bf16_ps8(_mm256_castsi256_si128(wa));
  const __m256 w23 = widen_bf16_ps8(_mm256_extracti128_si256(wa, 1));
  const __m256 w45 = widen_bf16_ps8(_mm256_castsi256_si128(wb));
  const __m256 w67 = widen_bf16_ps8(_mm256_extracti128_si256(wb, 1));
  const __m256 p = _mm256_permute2f128_ps(w01, w45, 0x20), q = _mm256_permute2f128_ps(w01, w45, 0x31);  // [0|4] [1|5]
  const __m256 r = _mm256_permute2f128_ps(w23, w67, 0x20), t = _mm256_permute2f128_ps(w23, w67, 0x31);  // [2|6] [3|7]
  const __m256 pq_lo = _mm256_unpacklo_ps(p, q), pq_hi = _mm256_unpackhi_ps(p, q);
  const __m256 rt_lo = _mm256_unpacklo_ps(r, t), rt_hi = _mm256_unpackhi_ps(r, t);
  const __m256 tap_w[4] = {_mm256_shuffle_ps(pq_lo, rt_lo, 0x44), _mm256_shuffle_ps(pq_lo, rt_lo, 0xEE),
                           _mm256_shuffle_ps(pq_hi, rt_hi, 0x44), _mm256_shuffle_ps(pq_hi, rt_hi, 0xEE)};
  at::BFloat16* sp = state + c0 * 3;  // e[3i + j]: channel i's tap j, 24 values
  const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp));
  const __m256 a = widen_bf16_ps8(_mm256_castsi256_si128(s16));
  const __m256 b = widen_bf16_ps8(_mm256_extracti128_si256(s16, 1));
  const __m256 c = widen_bf16_ps8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16)));
  // tap 0 of channels 0-7 is e0 e3 e6 | e9 e12 e15 | e18 e21: a[0 3 6], b[1 4 7], c[2 5]
  const __m256 tap_s0 = _mm256_blend_ps(
      _mm256_blend_ps(_mm256_permutevar8x32_ps(a, _mm256_setr_epi32(0, 3, 6, 6, 6, 6, 6, 6)),
                      _mm256_permutevar8x32_ps(b, _mm256_setr_epi32(1, 1, 1, 1, 4, 7, 7, 7)), 0b00111000),
      _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(2, 2, 2, 2, 2, 2, 2, 5)), 0b11000000);
  // tap 1: e1 e4 e7 | e10 e13 | e16 e19 e22: a[1 4 7], b[2 5], c[0 3 6]
  const __m256 tap_s1 = _mm256_blend_ps(
      _mm256_blend_ps(_mm256_permutevar8x32_ps(a, _mm256_setr_epi32(1, 4, 7, 7, 7, 7, 7, 7)),
                      _mm256_permutevar8x32_ps(b, _mm256_setr_epi32(2, 2, 2, 2, 5, 5, 5, 5)), 0b00011000),
      _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(0, 0, 0, 0, 0, 0, 3, 6)), 0b11100000);
  // tap 2: e2 e5 | e8 e11 e14 | e17 e20 e23: a[2 5], b[0 3 6], c[1 4 7]
  const __m256 tap_s2 = _mm256_blend_ps(
      _mm256_blend_ps(_mm256_permutevar8x32_ps(a, _mm256_setr_epi32(2, 5, 5, 5, 5, 5, 5, 5)),
                      _mm256_permutevar8x32_ps(b, _mm256_setr_epi32(0, 0, 0, 3, 6, 6, 6, 6)), 0b00011100),
      _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(1, 1, 1, 1, 1, 1, 4, 7)), 0b11100000);
  const __m256 xs = widen_bf16_ps8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + c0)));
  const __m256 taps[4] = {tap_s0, tap_s1, tap_s2, xs};
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) sum = _mm256_add_ps(sum, round_bf16_ps8(_mm256_mul_ps(taps[j], tap_w[j])));
  for (int64_t i = 0; i < 8; ++i) {  // the state shifts by one tap: [s1, s2, x]
    sp[3 * i] = sp[3 * i + 1];
    sp[3 * i + 1] = sp[3 * i + 2];
    sp[3 * i + 2] = x[c0 + i];
  }
  return round_bf16_ps8(sum);
}

CAIRN_AVX2 void conv_avx2(const at::BFloat16* x, at::BFloat16* state, int64_t sc, const at::BFloat16* w,
                          int64_t kernel, int64_t c0, int64_t c1, float* out) {
  for (int64_t b = c0; b < c1; b += 8) {
    const int64_t n = std::min<int64_t>(8, c1 - b);
    alignas(32) float acc[8] = {};
    __m256 sums;
    if (kernel == 4 && sc == 3 && n == 8) {
      sums = conv4_block8(x, state, w, b);
    } else {
      conv_taps(x, state, sc, w, kernel, b, b + n, acc);
      sums = _mm256_load_ps(acc);
    }
    _mm256_store_ps(acc, round_bf16_ps8(silu_ps8(sums)));
    std::memcpy(out + b, acc, n * sizeof(float));
  }
}

float inv_norm(const float* v, int64_t n, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
  return 1.0f / std::sqrt(ss + eps);
}

// One decode step of one (sequence, value head): the gating, the delta rule on its fp32 state and the
// gated norm. The state is read from memory once (S^T k and S^T q in one pass), then updated while it
// is in L2. The body is compiled three times: for AVX-512 (16-wide vectors and FMA; the loops over the state
// are elementwise, so GCC vectorises them), for AVX2 + FMA (8-wide) and for the baseline x86-64 (SSE2),
// picked once per call by the CPU. A given machine always runs the same one, so its results do not depend on the batch.
struct HeadArgs {
  const float* conv_out;
  int64_t C, key_dim, Dk, Dv, Hv, groups;
  float q_scale, eps;
  const at::BFloat16* b;
  int64_t b_stride;
  const at::BFloat16* a;
  int64_t a_stride;
  const at::BFloat16 *A_log, *dt_bias, *norm_weight, *z;
  int64_t z_stride;
  float* state;
  int64_t state_stride;
  at::BFloat16* out;
};
// The state streams from memory one row after another; a software prefetch a few rows ahead keeps more
// cache-line fills in flight than the hardware prefetcher alone (past the head's last row it fetches the
// next head's, usually this thread's next; prefetches never fault). Measured at batch 16 against scratch builds
// of the op without it or at another distance (figures kept here only): 1.2x with it, one thread; 4, 8 or 16 rows
// ahead alike. The op's current figures: docs/kernels.md.
constexpr int64_t kPrefetchRows = 8;
using HeadFn = void (*)(const HeadArgs&, int64_t, int64_t, float*);
using ConvFn = void (*)(const at::BFloat16*, at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, int64_t,
                        float*);

// the gated norm's last step, 16 lanes at a time: bf16(bf16(w * bf16(o * r)) * silu(z))
CAIRN_AVX512 void gate_avx512(const float* o, float r, const at::BFloat16* w, const at::BFloat16* z,
                              at::BFloat16* dst, int64_t Dv) {
  for (int64_t e = 0; e < Dv; e += 16) {
    const int64_t n = std::min<int64_t>(16, Dv - e);
    const __m512 oe = _mm512_maskz_loadu_ps(first_lanes(n), o + e);
    const __m512 normed_o = round_bf16_ps(_mm512_mul_ps(oe, _mm512_set1_ps(r)));
    const __m512 normed = round_bf16_ps(_mm512_mul_ps(load_bf16_ps(w + e, n), normed_o));
    store_bf16_ps(dst + e, _mm512_mul_ps(normed, silu_ps(load_bf16_ps(z + e, n))), n);
  }
}

// the same, 8 lanes at a time
CAIRN_AVX2 void gate_avx2(const float* o, float r, const at::BFloat16* w, const at::BFloat16* z, at::BFloat16* dst,
                          int64_t Dv) {
  for (int64_t e = 0; e < Dv; e += 8) {
    const int64_t n = std::min<int64_t>(8, Dv - e);
    alignas(32) float oe[8] = {};
    std::memcpy(oe, o + e, n * sizeof(float));
    const __m256 normed_o = round_bf16_ps8(_mm256_mul_ps(_mm256_load_ps(oe), _mm256_set1_ps(r)));
    const __m256 normed = round_bf16_ps8(_mm256_mul_ps(load_bf16_ps8(w + e, n), normed_o));
    store_bf16_ps8(dst + e, _mm256_mul_ps(normed, silu_ps8(load_bf16_ps8(z + e, n))), n);
  }
}

enum class Body { generic, avx2, avx512 };

template <Body Vec>
__attribute__((always_inline)) inline void head_body(const HeadArgs& p, int64_t s, int64_t h, float* buf) {
  const int64_t Dk = p.Dk, Dv = p.Dv, hk = h / p.groups;
  float *q = buf, *k = q + Dk, *rk = k + Dk, *rq = rk + Dv, *delta = rq + Dv, *o = delta + Dv;
  const float* row = p.conv_out + s * p.C;
  for (int64_t d = 0; d < Dk; ++d) { q[d] = row[hk * Dk + d]; k[d] = row[p.key_dim + hk * Dk + d]; }
  const float nq = inv_norm(q, Dk, 1e-6f), nk = inv_norm(k, Dk, 1e-6f);
  for (int64_t d = 0; d < Dk; ++d) { q[d] = q[d] * nq * p.q_scale; k[d] *= nk; }
  const float* v = row + 2 * p.key_dim + h * Dv;
  const float beta = bf(1.0f / (1.0f + std::exp(-float(p.b[s * p.b_stride + h]))));
  const float g = -std::exp(float(p.A_log[h])) * softplus(float(p.a[s * p.a_stride + h]) + float(p.dt_bias[h]));
  const float decay = std::exp(g);
  float* S = p.state + s * p.state_stride + h * Dk * Dv;
  for (int64_t e = 0; e < Dv; ++e) rk[e] = rq[e] = 0.0f;
  for (int64_t d = 0; d < Dk; ++d) {  // S^T k and S^T q in one pass, prefetching kPrefetchRows rows ahead
    const float* Sd = S + d * Dv;
    for (int64_t e = 0; e < Dv; e += 16) __builtin_prefetch(Sd + kPrefetchRows * Dv + e);
    const float kd = k[d], qd = q[d];
    for (int64_t e = 0; e < Dv; ++e) { rk[e] += Sd[e] * kd; rq[e] += Sd[e] * qd; }
  }
  float kq = 0.0f;
  for (int64_t d = 0; d < Dk; ++d) kq += k[d] * q[d];
  for (int64_t e = 0; e < Dv; ++e) {
    delta[e] = (v[e] - rk[e] * decay) * beta;
    o[e] = bf(rq[e] * decay + kq * delta[e]);
  }
  for (int64_t d = 0; d < Dk; ++d) {  // S <- decay S + k delta^T
    float* Sd = S + d * Dv;
    const float kd = k[d];
    for (int64_t e = 0; e < Dv; ++e) Sd[e] = Sd[e] * decay + kd * delta[e];
  }
  float ms = 0.0f;
  for (int64_t e = 0; e < Dv; ++e) ms += o[e] * o[e];
  const float r = 1.0f / std::sqrt(ms / float(Dv) + p.eps);
  const at::BFloat16* zr = p.z + s * p.z_stride + h * Dv;
  at::BFloat16* dst = p.out + s * (p.Hv * Dv) + h * Dv;
  if constexpr (Vec == Body::avx512) {
    gate_avx512(o, r, p.norm_weight, zr, dst, Dv);
  } else if constexpr (Vec == Body::avx2) {
    gate_avx2(o, r, p.norm_weight, zr, dst, Dv);
  } else {
    for (int64_t e = 0; e < Dv; ++e) {
      const float normed = bf(float(p.norm_weight[e]) * bf(o[e] * r));
      dst[e] = c10::BFloat16(normed * silu(float(zr[e])));
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), flatten))
void head_avx512(const HeadArgs& p, int64_t s, int64_t h, float* buf) { head_body<Body::avx512>(p, s, h, buf); }

__attribute__((target("avx2,fma"), flatten))
void head_avx2(const HeadArgs& p, int64_t s, int64_t h, float* buf) { head_body<Body::avx2>(p, s, h, buf); }

__attribute__((flatten)) void head_generic(const HeadArgs& p, int64_t s, int64_t h, float* buf) {
  head_body<Body::generic>(p, s, h, buf);
}

// The body this CPU runs, up to `max_body` (2 AVX-512, 1 AVX2, 0 the baseline x86-64: the path's cap, cpu_isa.body):
// AVX-512 (with BW, DQ and VL), else AVX2 + FMA, else the baseline x86-64.
Body body_for_cpu(int64_t max_body) {
  if (max_body >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return Body::avx512;
  return max_body >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Body::avx2 : Body::generic;
}

}  // namespace

// mixed [B, C] bf16 (q k v channels), z [B, Hv * Dv], b / a [B, Hv]; conv_state [B, C, K-1] bf16 and
// rec_state [B, Hv, Dk, Dv] fp32, both updated in place (views into the state pool are fine: strides
// are honoured for the batch and channel dimensions); conv_weight [C, K], A_log / dt_bias [Hv],
// norm_weight [Dv] bf16; max_body the widest body to run (body_for_cpu). Returns the gated, normed output
// [B, Hv * Dv] bf16 (out_proj's input).
torch::Tensor gdn_decode(const torch::Tensor& mixed, const torch::Tensor& z, const torch::Tensor& b,
                         const torch::Tensor& a, torch::Tensor conv_state, torch::Tensor rec_state,
                         const torch::Tensor& conv_weight, const torch::Tensor& A_log, const torch::Tensor& dt_bias,
                         const torch::Tensor& norm_weight, int64_t k_heads, double norm_eps, int64_t max_body) {
  const std::initializer_list<const torch::Tensor*> halves = {&mixed, &z, &b, &a, &conv_state, &conv_weight,
                                                              &A_log, &dt_bias, &norm_weight};
  for (const torch::Tensor* t : halves)
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "gdn_decode: bf16 tensors (and an fp32 recurrent state)");
  TORCH_CHECK(rec_state.scalar_type() == at::kFloat && rec_state.dim() == 4,
              "gdn_decode: rec_state [B, Hv, Dk, Dv] fp32");
  const int64_t B = mixed.size(0), C = mixed.size(1), K = conv_weight.size(1);
  const int64_t Hv = rec_state.size(1), Dk = rec_state.size(2), Dv = rec_state.size(3), Hk = k_heads;
  const int64_t key_dim = Hk * Dk, groups = Hv / Hk;
  TORCH_CHECK(C == 2 * key_dim + Hv * Dv && conv_state.size(1) == C && conv_state.size(2) == K - 1 && K >= 2,
              "gdn_decode: shapes");
  TORCH_CHECK(mixed.stride(1) == 1 && z.stride(1) == 1 && b.stride(1) == 1 && a.stride(1) == 1 &&
              conv_state.stride(2) == 1 && conv_weight.is_contiguous() && A_log.is_contiguous() &&
              dt_bias.is_contiguous() && norm_weight.is_contiguous(), "gdn_decode: contiguous rows");
  TORCH_CHECK(rec_state.stride(3) == 1 && rec_state.stride(2) == Dv && rec_state.stride(1) == Dk * Dv,
              "gdn_decode: each sequence's recurrent state contiguous");
  auto conv_out = torch::empty({B, C}, mixed.options().dtype(at::kFloat));
  auto out = torch::empty({B, Hv * Dv}, mixed.options());
  float* co = conv_out.data_ptr<float>();
  const auto* w = conv_weight.data_ptr<at::BFloat16>();
  auto* cs = conv_state.data_ptr<at::BFloat16>();
  const auto* mx = mixed.data_ptr<at::BFloat16>();
  const auto* zp = z.data_ptr<at::BFloat16>();
  const auto* bp = b.data_ptr<at::BFloat16>();
  const auto* ap = a.data_ptr<at::BFloat16>();
  const auto* alog = A_log.data_ptr<at::BFloat16>();
  const auto* dtb = dt_bias.data_ptr<at::BFloat16>();
  const auto* nw = norm_weight.data_ptr<at::BFloat16>();
  float* rs = rec_state.data_ptr<float>();
  auto* op = out.data_ptr<at::BFloat16>();
  const float q_scale = 1.0f / std::sqrt(float(Dk)), eps = float(norm_eps);
  const HeadArgs args{co, C, key_dim, Dk, Dv, Hv, groups, q_scale, eps, bp, b.stride(0), ap, a.stride(0), alog, dtb,
                      nw, zp, z.stride(0), rs, rec_state.stride(0), op};
  const Body body = body_for_cpu(max_body);
  const HeadFn head = body == Body::avx512 ? head_avx512 : body == Body::avx2 ? head_avx2 : head_generic;
  const ConvFn conv = body == Body::avx512 ? conv_avx512 : body == Body::avx2 ? conv_avx2 : conv_generic;
  // One parallel region: a task is one sequence's key head, its q / k channels' and its value heads' conv
  // update, then those value heads' step (each reads only channels its own task computed).
  at::parallel_for(0, B * Hk, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(2 * Dk + 4 * Dv);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t s = i / Hk, hk = i % Hk;
      const at::BFloat16* xs = mx + s * mixed.stride(0);
      at::BFloat16* ss = cs + s * conv_state.stride(0);
      float* out_s = co + s * C;
      const int64_t sc = conv_state.stride(1);
      conv(xs, ss, sc, w, K, hk * Dk, (hk + 1) * Dk, out_s);
      conv(xs, ss, sc, w, K, key_dim + hk * Dk, key_dim + (hk + 1) * Dk, out_s);
      conv(xs, ss, sc, w, K, 2 * key_dim + hk * groups * Dv, 2 * key_dim + (hk + 1) * groups * Dv, out_s);
      for (int64_t h = hk * groups; h < (hk + 1) * groups; ++h) head(args, s, h, buf.data());
    }
  });
  return out;
}

// Which body gdn_decode runs on this CPU up to `max_body`: "avx512", "avx2" or "generic".
std::string vector_body(int64_t max_body) {
  const Body body = body_for_cpu(max_body);
  return body == Body::avx512 ? "avx512" : body == Body::avx2 ? "avx2" : "generic";
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gdn_decode", torch::wrap_pybind_function(gdn_decode), "gdn_decode");
  m.def("vector_body", torch::wrap_pybind_function(vector_body), "vector_body");
}
