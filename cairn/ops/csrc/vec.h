// AVX-512 and AVX2 helpers shared by cairn's CPU C++ ops (gdn.cpp, silu.cpp, attention.cpp): each includes this file
// inside its anonymous namespace, after <immintrin.h>, <cmath>, <cstring> and c10's BFloat16. (It closes and reopens
// that namespace around its extern "C" declarations of libtorch's exps.)
//
// It gives, 16 floats at a time (functions compiled for AVX-512 only; callers pick them when the CPU has it):
//
// - round_bf16_ps: c10::BFloat16(float) as a float, bit for bit (round to nearest even; NaN to 0x7fc0);
// - exp_ps: libtorch's own Sleef_expf16_u10, the function ATen's vectorised `exp` (and so its bf16 `silu`) calls on
//   AVX-512 builds, so silu_ps gives ATen's bits; where libtorch does not export it (a weak symbol, null then),
//   std::exp lane by lane;
// - silu_ps: x / (1 + exp(-x)), ATen's formula;
// - load_bf16_ps / store_bf16_ps: n <= 16 bf16 widened to floats, floats rounded to n bf16;
//
// and the same 8 floats at a time for AVX2 + FMA (names ending in 8: round_bf16_ps8, exp_ps8, silu_ps8,
// load_bf16_ps8, store_bf16_ps8, and widen_bf16_ps8 for 8 bf16 already in a register), with libtorch's
// Sleef_expf8_u10, the exp ATen's vectorised code calls on AVX2 builds (its CPU capability on a CPU without AVX-512).

#define CAIRN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

}  // namespace
extern "C" __attribute__((weak, target("avx512f"))) __m512 Sleef_expf16_u10(__m512);
namespace {

CAIRN_AVX512 inline __m512 round_bf16_ps(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}

CAIRN_AVX512 inline __m512 exp_ps(__m512 v) {
  if (Sleef_expf16_u10) return Sleef_expf16_u10(v);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  for (float& f : lanes) f = std::exp(f);
  return _mm512_load_ps(lanes);
}

CAIRN_AVX512 inline __m512 silu_ps(__m512 x) {
  const __m512 minus_x = _mm512_xor_ps(x, _mm512_set1_ps(-0.0f));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(minus_x)));
}

CAIRN_AVX512 inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

CAIRN_AVX512 inline __m512 load_bf16_ps(const at::BFloat16* p, int64_t n) {
  const __m256i h = _mm256_maskz_loadu_epi16(first_lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

CAIRN_AVX512 inline void store_bf16_ps(at::BFloat16* p, __m512 v, int64_t n) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(v)), 16);
  _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtepi32_epi16(bits));
}

// ---- AVX2 + FMA: the same, 8 floats at a time --------------------------------------------------------
#define CAIRN_AVX2 __attribute__((target("avx2,fma")))

}  // namespace
extern "C" __attribute__((weak, target("avx2"))) __m256 Sleef_expf8_u10(__m256);
namespace {

CAIRN_AVX2 inline __m256 round_bf16_ps8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

CAIRN_AVX2 inline __m256 exp_ps8(__m256 v) {
  if (Sleef_expf8_u10) return Sleef_expf8_u10(v);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (float& f : lanes) f = std::exp(f);
  return _mm256_load_ps(lanes);
}

CAIRN_AVX2 inline __m256 silu_ps8(__m256 x) {
  const __m256 minus_x = _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps8(minus_x)));
}

// 8 bf16 (their bits in a 128-bit vector) widened to floats: a shift each
CAIRN_AVX2 inline __m256 widen_bf16_ps8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// (AVX2 has no masked 16-bit loads: a whole vector is loaded directly, a last partial one through a buffer)
CAIRN_AVX2 inline __m256 load_bf16_ps8(const at::BFloat16* p, int64_t n) {
  __m128i h;
  if (n >= 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t part[8] = {};
    std::memcpy(part, p, n * sizeof(uint16_t));
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
  }
  return widen_bf16_ps8(h);
}

CAIRN_AVX2 inline void store_bf16_ps8(at::BFloat16* p, __m256 v, int64_t n) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_ps8(v)), 16);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  } else {
    alignas(16) uint16_t part[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(part), h);
    std::memcpy(p, part, n * sizeof(uint16_t));
  }
}
