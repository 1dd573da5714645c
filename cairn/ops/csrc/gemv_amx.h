// The AMX-BF16 path of cairn's CPU gemv kernel: included once, by gemv.cpp, inside its anonymous namespace, after
// the AVX512-BF16 path (it uses `kPrefetch` and `has_avx512_bf16` from there) and the AVX2 ones (gemv_avx2.h), and
// before `gemv()`, which calls `gemv_amx` and `has_amx_bf16`.
//
// How it computes, and why every call runs the same instructions whatever its rows of x, is said at its top; what it
// measures alone is in docs/kernels.md.

// ---- AMX-BF16: 16 weight rows x 32 bf16 per tile, against every row of x at once --------------------
// C^T = W x^T: the weight is the A operand as it lies (16 rows of 64 bytes, row stride k), x the B
// operand packed once per call into AMX's pair layout and padded with zeros to 16 rows, so every call
// runs the same instructions whatever its rows: an output C[n][m] depends on W's row n and x's row m
// only, summed over k in one fixed order (tile by tile), bit for bit alike at 1 row or 16.
bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d & (1u << 22)) && (d & (1u << 24));  // AMX-BF16, AMX-TILE
}

// Linux lends a process the AMX tile state only when asked (arch_prctl, Linux 5.16+); oneDNN asks too.
bool has_amx_bf16() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return has_avx512_bf16() && cpu_has_amx_bf16() && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x [m_rows, k] -> xb[chunk][pair][m][2] = x[m][32 chunk + 2 pair + j], zeros past m_rows and k.
void pack_x(const uint16_t* x, int64_t x_stride, int64_t m_rows, int64_t k, uint16_t* xb) {
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t i = 0; i < k; ++i) xb[(i / 2) * 32 + m * 2 + (i & 1)] = x[m * x_stride + i];
}

// GCC's tile load / store intrinsics are asm statements that do not tell the compiler they touch memory:
// this barrier keeps the stores into a buffer before a tile load of it, and tile stores before reads.
inline void memory_fence() { asm volatile("" ::: "memory"); }

// NB blocks of 16 weight rows (row stride k) -> out [NB * 16][16] fp32. Tiles: 0, 1 accumulate, 2, 3 the
// weight blocks, 4 the packed x. A k % 32 tail goes through a zero-padded copy.
template <int NB>
__attribute__((target("amx-tile,amx-bf16,avx512f")))
void amx_block(const uint16_t* w, int64_t k, const uint16_t* xb, float* out) {
  memory_fence();  // the caller's stores into a padded copy of w land before the first tile load
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  const int64_t full = k / 32, stride = k * 2;
  for (int64_t c = 0; c < full; ++c) {
    for (int r = 0; r < 16 * NB; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + r * k + c * 32) + kPrefetch, _MM_HINT_T0);
    _tile_loadd(4, xb + c * 512, 64);
    _tile_loadd(2, w + c * 32, stride);
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (NB == 2) {
      _tile_loadd(3, w + 16 * k + c * 32, stride);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  if (k % 32) {
    alignas(64) uint16_t tail[32 * 32] = {};
    for (int r = 0; r < 16 * NB; ++r) std::memcpy(tail + r * 32, w + r * k + full * 32, (k % 32) * 2);
    memory_fence();
    _tile_loadd(4, xb + full * 512, 64);
    _tile_loadd(2, tail, 64);
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (NB == 2) {
      _tile_loadd(3, tail + 16 * 32, 64);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(0, out, 64);
  if constexpr (NB == 2) _tile_stored(1, out + 256, 64);
  memory_fence();
}

// Blocks of 32 weight rows on this thread, `chunk` at a time from the shared counter `next` until all `blocks`
// are taken (a thread that streams faster takes more: no thread waits for a slower one's fixed half); its own tile
// configuration, released at the end. Which thread computes a row does not change its bits.
__attribute__((target("amx-tile,amx-bf16,avx512f")))
void amx_range(const uint16_t* w, int64_t n, int64_t k, const uint16_t* xb, int64_t m_rows, at::BFloat16* y,
               std::atomic<int64_t>& next, int64_t blocks, int64_t chunk) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  alignas(64) float acc[32 * 16];
  std::vector<uint16_t> padded;  // the last rows of W when fewer than 16 remain, zero-padded to 16
  for (int64_t b0 = next.fetch_add(chunk); b0 < blocks; b0 = next.fetch_add(chunk)) {
   for (int64_t b = b0; b < std::min(b0 + chunk, blocks); ++b) {
    const int64_t n0 = b * 32, rows = std::min<int64_t>(32, n - n0);
    if (rows == 32) {
      amx_block<2>(w + n0 * k, k, xb, acc);
    } else {
      for (int64_t sub = 0; sub < rows; sub += 16) {
        const int64_t r = std::min<int64_t>(16, rows - sub);
        const uint16_t* src = w + (n0 + sub) * k;
        if (r < 16) {
          padded.assign(16 * k, 0);
          std::memcpy(padded.data(), src, r * k * 2);
          src = padded.data();
        }
        amx_block<1>(src, k, xb, acc + sub * 16);
      }
    }
    for (int64_t m = 0; m < m_rows; ++m)
      for (int64_t r = 0; r < rows; ++r) y[m * n + n0 + r] = c10::BFloat16(acc[r * 16 + m]);
   }
  }
  _tile_release();
}

torch::Tensor gemv_amx(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t m_rows = x.size(0), n = w.size(0), k = w.size(1);
  auto y = torch::empty({m_rows, n}, x.options());
  if (m_rows == 0 || n == 0) return y;
  const int64_t chunks = (k + 31) / 32;
  std::vector<uint16_t> xb(chunks * 512, 0);
  pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), m_rows, k, xb.data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = (n + 31) / 32;
  const int64_t chunk = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, k * 64));  // ~64 KiB a take
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (blocks + chunk - 1) / chunk);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    amx_range(wp, n, k, xb.data(), m_rows, yp, next, blocks, chunk);
  });
  return y;
}
