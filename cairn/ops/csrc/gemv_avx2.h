// The AVX2 + FMA paths of cairn's CPU gemv kernel: included once, by gemv.cpp, inside its anonymous namespace,
// after the AVX512-BF16 path and before the AMX one (gemv_amx.h).
//
// The row-major dot-product kernel against x widened to fp32, its walk over the weight, and the outer-product kernel
// on the packed weight (cairn/ops/cpu_gemv.py: pack, pack_int8). How each computes, and why an output's bits do not
// depend on the rows, tiles or threads, is said below; what they measure alone is in docs/kernels.md, and in a
// decode step BENCHMARKS.md's "Decode speed in bf16" (Zen 3).

// ---- AVX2 + FMA: R weight rows side by side against x widened to fp32 once per call ------------------
// No bf16 dot product here, so the weights are widened in registers: a 256-bit load holds 16 bf16 as 8
// pairs, and (pair << 16) is the even element as an fp32, (pair & 0xffff0000) the odd one, two integer
// ops for 16 weights. x is widened once per call (gemv_avx2) into the same order: per chunk of 16, its
// 8 even elements then its 8 odd ones, zero-padded to whole chunks. Each (weight row, row of x) keeps
// one fp32 accumulator over the chunks in order, even half then odd half; the chunk past the last whole
// one reads the row's tail from a zero-padded copy. So an output's sum depends on its row and K alone,
// not on R, on the rows of x beside it or on the thread. R rows side by side, each stream prefetched
// kPrefetchAvx2 bytes ahead, keep enough cache-line fills in flight to read at memory speed.
constexpr int64_t kChunk = 16;
constexpr int64_t kPrefetchAvx2 = 512;

__attribute__((target("avx2,fma")))
inline __m256 fma_chunk(__m256i pairs, const float* xs, __m256 acc) {
  const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))));
  acc = _mm256_fmadd_ps(even, _mm256_loadu_ps(xs), acc);
  return _mm256_fmadd_ps(odd, _mm256_loadu_ps(xs + 8), acc);
}

__attribute__((target("avx2,fma")))
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The last k % 16 weights of a row, zero-padded to one chunk (never read past the row: it may end the weight).
__attribute__((target("avx2,fma")))
inline __m256i tail_pairs(const uint16_t* row, int64_t k) {
  alignas(32) uint16_t tail[kChunk] = {};
  std::memcpy(tail, row + k / kChunk * kChunk, (k % kChunk) * sizeof(uint16_t));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
}

// x [m_rows, k] bf16 -> xs [m_rows, padded] fp32 in fma_chunk's order (padded: k rounded up to 16).
__attribute__((target("avx2,fma")))
void widen_x_avx2(const uint16_t* x, int64_t x_stride, int64_t m_rows, int64_t k, float* xs, int64_t padded) {
  for (int64_t m = 0; m < m_rows; ++m) {
    const uint16_t* row = x + m * x_stride;
    float* out = xs + m * padded;
    for (int64_t c = 0; c * kChunk < k; ++c) {
      const __m256i pairs = (c + 1) * kChunk <= k
          ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * kChunk)) : tail_pairs(row, k);
      _mm256_storeu_ps(out + c * kChunk, _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)));
      _mm256_storeu_ps(out + c * kChunk + 8,
                       _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u)))));
    }
  }
}

template <int R, int M>
__attribute__((target("avx2,fma")))
void tile_avx2(const uint16_t* w, int64_t k, const float* xs, int64_t xs_stride, float* out, int64_t out_stride) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t full = k / kChunk;
  for (int64_t c = 0; c < full; ++c) {
    for (int r = 0; r < R; ++r) {
      const uint16_t* p = w + r * k + c * kChunk;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchAvx2, _MM_HINT_T0);
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      for (int m = 0; m < M; ++m) acc[r][m] = fma_chunk(pairs, xs + m * xs_stride + c * kChunk, acc[r][m]);
    }
  }
  if (k % kChunk) {
    for (int r = 0; r < R; ++r) {
      const __m256i pairs = tail_pairs(w + r * k, k);
      for (int m = 0; m < M; ++m) acc[r][m] = fma_chunk(pairs, xs + m * xs_stride + full * kChunk, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[m * out_stride + r] = sum8(acc[r][m]);
}

using Tile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t);

// How one call walks the weight: tiles of `rows` weight rows side by side, each against every row of x
// in passes of up to `width` rows (tiles[rows of the pass]); the last n % rows weight rows one at a time
// (single[...]). R x M accumulators must fit the 32 vector registers: 16 weight rows at one row of x,
// 8 at two, 4 in passes of up to four above.
struct Plan {
  int rows = 0, width = 0;
  Tile tiles[5] = {};
  Tile single[5] = {};
};

bool has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// The AVX512-BF16 plan for m_rows rows of x (rows == 0 where this CPU lacks it). On AMD (Zen 4) one core reads
// one stream at the machine's full read bandwidth and several side by side at 60-75% of it (a sweep of R and M,
// 2 cores: R = 1 read 49-52 GB/s where R = 16 read 25-28 and R = 8 at two rows 22), so there the tile is one
// weight row up to eight rows of x; on Intel 16 / 8 / 4 rows side by side were measured fastest (above). Each
// output's sum is the same chain whatever the tile, so the plan changes speed, never bits.
Plan plan_avx512(int64_t m_rows) {
  Plan p;
  if (has_avx512_bf16()) {
    const bool one_stream = __builtin_cpu_is("amd");
    p.rows = one_stream ? (m_rows <= 8 ? 1 : 4) : m_rows == 1 ? 16 : m_rows == 2 ? 8 : 4;
    p.width = int(std::min<int64_t>(m_rows, 4));
    const Tile by_rows[3][5] = {
        {nullptr, tile_avx512<16, 1>, nullptr, nullptr, nullptr},
        {nullptr, tile_avx512<8, 1>, tile_avx512<8, 2>, nullptr, nullptr},
        {nullptr, tile_avx512<4, 1>, tile_avx512<4, 2>, tile_avx512<4, 3>, tile_avx512<4, 4>}};
    const Tile single[5] = {nullptr, tile_avx512<1, 1>, tile_avx512<1, 2>, tile_avx512<1, 3>, tile_avx512<1, 4>};
    for (int m = 0; m < 5; ++m) {
      p.tiles[m] = p.rows == 1 ? single[m] : by_rows[p.rows == 16 ? 0 : p.rows == 8 ? 1 : 2][m];
      p.single[m] = single[m];
    }
  }
  return p;
}

// One tile of weight rows against every row of x: the first pass streams the weights from memory,
// the later passes (more than four rows of x) find them in L1/L2.
void run_tile(const Plan& p, bool whole, const uint16_t* w, int64_t k, const uint16_t* x, int64_t x_stride,
              int64_t m_rows, float* acc, int64_t acc_stride) {
  for (int64_t m0 = 0; m0 < m_rows; m0 += p.width) {
    const int mm = int(std::min<int64_t>(p.width, m_rows - m0));
    (whole ? p.tiles : p.single)[mm](w, k, x + m0 * x_stride, x_stride, acc + m0 * acc_stride, acc_stride);
  }
}

// ---- the AVX2 path's walk over the weight -----------------------------------------------------------
// Tiles of R weight rows side by side, each against every row of x in passes of up to four rows (the
// later passes find the tile's weights in L1/L2); the last n % R rows one at a time. R x M accumulators
// plus the pairs and their two halves fit AVX2's 16 registers: 8 weight rows at one row of x, 4 at two,
// 2 in passes of three or four.
using TileAvx2 = void (*)(const uint16_t*, int64_t, const float*, int64_t, float*, int64_t);

struct PlanAvx2 {
  int rows = 0;
  TileAvx2 tiles[5] = {};
  TileAvx2 single[5] = {};
};

PlanAvx2 plan_avx2(int64_t m_rows) {
  PlanAvx2 p;
  p.rows = m_rows == 1 ? 8 : m_rows == 2 ? 4 : 2;
  const TileAvx2 by_rows[3][5] = {
      {nullptr, tile_avx2<8, 1>, nullptr, nullptr, nullptr},
      {nullptr, tile_avx2<4, 1>, tile_avx2<4, 2>, nullptr, nullptr},
      {nullptr, tile_avx2<2, 1>, tile_avx2<2, 2>, tile_avx2<2, 3>, tile_avx2<2, 4>}};
  const TileAvx2 single[5] = {nullptr, tile_avx2<1, 1>, tile_avx2<1, 2>, tile_avx2<1, 3>, tile_avx2<1, 4>};
  for (int m = 0; m < 5; ++m) {
    p.tiles[m] = by_rows[p.rows == 8 ? 0 : p.rows == 4 ? 1 : 2][m];
    p.single[m] = single[m];
  }
  return p;
}

void run_tile_avx2(const PlanAvx2& p, bool whole, const uint16_t* w, int64_t k, const float* xs, int64_t padded,
                   int64_t m_rows, float* acc, int64_t acc_stride) {
  const int64_t width = std::min<int64_t>(m_rows, 4);
  for (int64_t m0 = 0; m0 < m_rows; m0 += width) {
    const int mm = int(std::min<int64_t>(width, m_rows - m0));
    (whole ? p.tiles : p.single)[mm](w, k, xs + m0 * padded, padded, acc + m0 * acc_stride, acc_stride);
  }
}

torch::Tensor gemv_avx2(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t m_rows = x.size(0), n = w.size(0), k = w.size(1);
  auto y = torch::empty({m_rows, n}, x.options());
  if (m_rows == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t padded = (k + kChunk - 1) / kChunk * kChunk;
  std::vector<float> xs(std::max<int64_t>(1, m_rows * padded));  // at most 16 rows of K floats: L2-sized
  widen_x_avx2(xp, x.stride(0), m_rows, k, xs.data(), padded);
  const PlanAvx2 p = plan_avx2(m_rows);
  const int64_t tiles = (n + p.rows - 1) / p.rows;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, k * p.rows * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    float acc[kMaxRows * 8];  // [m_rows, p.rows]: m_rows * p.rows <= 32 (8 x 1, 4 x 2, 2 x up to 16)
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * p.rows, rows = std::min<int64_t>(p.rows, n - n0);
      if (rows == p.rows) {
        run_tile_avx2(p, true, wp + n0 * k, k, xs.data(), padded, m_rows, acc, p.rows);
      } else {
        for (int64_t r = 0; r < rows; ++r)
          run_tile_avx2(p, false, wp + (n0 + r) * k, k, xs.data(), padded, m_rows, acc + r, p.rows);
      }
      for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t r = 0; r < rows; ++r) yp[m * n + n0 + r] = c10::BFloat16(acc[m * p.rows + r]);
    }
  });
  return y;
}

// ---- AVX2 + FMA on a packed weight: the outer-product form, as GEMM micro-kernels do ------------------
// The weight is re-laid once at load time (cpu_gemv.pack) into blocks of 16 output rows: block b holds,
// for k = 0..K-1, W[16b..16b+15, k] as 16 bf16 (32 bytes), output 16b+i at element 2i and 16b+8+i at
// element 2i+1. One 256-bit load then splits by fma_chunk's shift and mask into outputs 16b..16b+7 (the
// even halves) and 16b+8..16b+15 (the odd halves) as two fp32 vectors, and each row of x contributes one
// broadcast x[m, k] and two FMAs: per k, one weight load serves every row of x in the tile, and x is read
// once per 16 outputs instead of once per weight row. Each output keeps one fp32 accumulator, one FMA per k
// in order from k = 0: its sum is one sequential chain that depends on its weights and its row of x alone,
// not on the tile, the rows of x beside it, the thread or the call. NB blocks side by side x MT rows of x
// per tile: 2 * NB * MT accumulators, plus the pairs, their two halves and one broadcast, fit AVX2's 16
// registers for NB * MT <= 6 (NB = 4 at one row of x: 8 independent chains hide the FMA latency and keep 4
// prefetched streams in flight).
constexpr int64_t kBlock = 16;
constexpr int64_t kPrefetchPacked = 512;

// The packed formats: how one k's 16 weights of a block load and widen into two fp32 vectors, `lo` for the
// block's outputs 0..7 and `hi` for 8..15. bf16 (`pack`): 32 bytes, output i at element 2i and 8 + i at 2i + 1,
// split by one shift and one mask. int8 (`pack_int8`): 16 bytes in output order, each half sign-extended and
// converted (the product of an int8 and a bf16 x is exact in fp32, so the FMA rounds only the sum).
struct Bf16Block {
  using T = uint16_t;
  static constexpr int kPerLine = 2;  // k per 64-byte line of a block: one prefetch per line
  __attribute__((target("avx2,fma"))) static inline void widen(const T* p, __m256& lo, __m256& hi) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))));
  }
};

struct Int8Block {
  using T = int8_t;
  static constexpr int kPerLine = 4;
  __attribute__((target("avx2,fma"))) static inline void widen(const T* p, __m256& lo, __m256& hi) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
};

// NB blocks (starting at w, block_stride apart) against MT rows of x, as xt holds them: x transposed to fp32
// [K, xt_stride] (the tile's MT values of one k side by side, so their broadcasts share one address), into
// out[m][16b + i] in fp32. `no-ivopts` and `noinline`: with GCC's induction-variable pass, or inlined into the
// caller that rounds the outputs, every accumulator was also stored to the stack at every k (GCC 12, -O3).
template <class F, int NB, int MT>
__attribute__((target("avx2,fma"), optimize("no-ivopts"), noinline))
void packed_sums(const typename F::T* w, int64_t block_stride, int64_t k, const float* xt, int64_t xt_stride,
                 float (&out)[MT][NB * kBlock]) {
  __m256 acc[NB][MT][2];
  for (int b = 0; b < NB; ++b)
    for (int m = 0; m < MT; ++m) acc[b][m][0] = acc[b][m][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; ++j) {
    if (j % F::kPerLine == 0)
      for (int b = 0; b < NB; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(w + b * block_stride + j * kBlock) + kPrefetchPacked, _MM_HINT_T0);
    const float* xj = xt + j * xt_stride;
    for (int b = 0; b < NB; ++b) {
      __m256 lo, hi;
      F::widen(w + b * block_stride + j * kBlock, lo, hi);
      for (int m = 0; m < MT; ++m) {
        const __m256 xb = _mm256_broadcast_ss(xj + m);
        acc[b][m][0] = _mm256_fmadd_ps(lo, xb, acc[b][m][0]);
        acc[b][m][1] = _mm256_fmadd_ps(hi, xb, acc[b][m][1]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) {
      _mm256_storeu_ps(out[m] + b * kBlock, acc[b][m][0]);
      _mm256_storeu_ps(out[m] + b * kBlock + 8, acc[b][m][1]);
    }
}

// packed_sums, then the first `valid` outputs of each row rounded to bf16 into y (row stride y_stride), each
// multiplied first by its scale in fp32 where `scales` is given (int8: the output rows' scales from the tile's
// first one on).
template <class F, int NB, int MT>
void packed_tile(const typename F::T* w, int64_t block_stride, int64_t k, const float* xt, int64_t xt_stride,
                 const c10::BFloat16* scales, c10::BFloat16* y, int64_t y_stride, int64_t valid) {
  float out[MT][NB * kBlock];
  packed_sums<F, NB, MT>(w, block_stride, k, xt, xt_stride, out);
  for (int m = 0; m < MT; ++m)
    for (int64_t i = 0; i < valid; ++i)
      y[m * y_stride + i] = c10::BFloat16(scales ? out[m][i] * float(scales[i]) : out[m][i]);
}

template <class F>
using PackedTile = void (*)(const typename F::T*, int64_t, int64_t, const float*, int64_t, const c10::BFloat16*,
                            c10::BFloat16*, int64_t, int64_t);

// packed_tile<F, NB, MT> by [NB][MT] (nullptr where NB * MT > 6, but NB = 4 at MT = 1).
template <class F>
PackedTile<F> packed_tile_for(int nb, int mt) {
  static const PackedTile<F> table[5][7] = {
      {},
      {nullptr, packed_tile<F, 1, 1>, packed_tile<F, 1, 2>, packed_tile<F, 1, 3>, packed_tile<F, 1, 4>,
       packed_tile<F, 1, 5>, packed_tile<F, 1, 6>},
      {nullptr, packed_tile<F, 2, 1>, packed_tile<F, 2, 2>, packed_tile<F, 2, 3>},
      {nullptr, packed_tile<F, 3, 1>, packed_tile<F, 3, 2>},
      {nullptr, packed_tile<F, 4, 1>}};
  return nb >= 1 && nb <= 4 && mt >= 1 && mt <= 6 ? table[nb][mt] : nullptr;
}

// The tile for m_rows rows of x: (blocks side by side, rows of x per pass). Measured (gemv_step_bench.py --tiles,
// on Zen 3): 4 x 1 at one row; 3 x 2 at two; 2 x 3 at three; above, 1 x 6 in passes of up to six rows.
std::pair<int, int> packed_plan(int64_t m_rows) {
  if (m_rows == 1) return {4, 1};
  if (m_rows == 2) return {3, 2};
  if (m_rows == 3) return {2, 3};
  return {1, 6};
}

// x [M, K] bf16 (rows contiguous) -> xt [K, M] fp32: x transposed, so that a tile's rows of one k lie side by side.
void widen_transposed(const uint16_t* x, int64_t x_stride, int64_t m_rows, int64_t k, float* xt) {
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t j = 0; j < k; ++j) {
      const uint32_t bits = uint32_t(x[m * x_stride + j]) << 16;
      std::memcpy(xt + j * m_rows + m, &bits, 4);
    }
}

