"""A bf16 gemv for CPU decode: y = x W^T for a few rows x, streaming W once at memory speed.

What it is: a small C++ kernel built on first use with torch.utils.cpp_extension.load_inline (cached
by torch under its extensions directory, so a machine compiles it once). Per output row it keeps fp32
accumulators and reads the row's weights once for every row of x (up to MAX_ROWS); its three
instruction paths, the best the CPU has chosen once when the library loads:

- amx_bf16: AMX tiles (`_tile_dpbf16ps`): 16 weight rows x 32 bf16 as they lie in memory against x
  packed into AMX's pair layout and zero-padded to 16 rows, so one instruction serves every row of x
  and a call at 1 row runs the same instructions as one at 16; 32 weight rows per step, each prefetched
  256 bytes ahead. Its outputs equalled F.linear's (oneDNN's AMX kernel) bit for bit on the shapes
  tried. Linux must grant the process the tile state (arch_prctl); where it does not, the kernel takes
  the AVX512-BF16 path;
- avx512_bf16: `_mm512_dpbf16_ps`, 32 bf16 products per instruction; 16 weight rows streamed side by side
  for one row of x (8 for two, 4 above), each stream with a software prefetch 256 bytes ahead;
- avx2: bf16 widened to fp32 by a shift, `_mm256_fmadd_ps`, one weight row at a time.

Rows of W are split between the torch threads (`at::parallel_for`, ATen's OpenMP pool; on the AMX path
each thread takes the next blocks of 32 rows from a shared counter until none is left). Each output is
a fixed-order sum over its row alone, so it does not depend on how many rows x has, on the thread
count or on the other rows: decode and a short prefill piece compute a token's outputs bit for bit
alike. The result is rounded to bf16 once, like F.linear's (within bf16 rounding of it; tests compare).

What it is not: a GEMM. Above MAX_ROWS rows the caller keeps F.linear (prefill). No bias. On a CPU
without AVX2 + FMA, without a C++ compiler, or where the build fails, `load()` returns None with the
reason, and the caller stays with F.linear.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cairn.ops.cpu_build import build_inline
from cairn.ops.cpu_gemv_amx import AMX_SOURCE

MAX_ROWS = 16  # rows of x the kernel takes; more is a GEMM's job
NAME = "cairn_cpu_gemv4"  # torch caches builds by name: a new kernel source gets a new name

_SOURCE = r"""
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

// ---- AVX2 + FMA: one weight row at a time, bf16 widened to fp32 ------------------------------------
__attribute__((target("avx2,fma")))
inline __m256 widen8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

__attribute__((target("avx2,fma")))
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float widen1(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int R, int M>
__attribute__((target("avx2,fma")))
void tile_avx2(const uint16_t* w, int64_t k, const uint16_t* x, int64_t x_stride, float* out, int64_t out_stride) {
  static_assert(R == 1, "the AVX2 path takes one weight row at a time");
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t full = k / 8;
  for (int64_t c = 0; c < full; ++c) {
    __m256 wv = widen8(w + c * 8);
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, widen8(x + m * x_stride + c * 8), acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    float s = sum8(acc[m]);
    for (int64_t i = full * 8; i < k; ++i) s += widen1(w[i]) * widen1(x[m * x_stride + i]);
    out[m * out_stride] = s;
  }
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

// The plan for m_rows rows of x on `isa` (rows == 0 where this CPU lacks it).
Plan plan_for(const std::string& isa, int64_t m_rows) {
  Plan p;
  if (isa == "avx512_bf16" && has_avx512_bf16()) {
    p.rows = m_rows == 1 ? 16 : m_rows == 2 ? 8 : 4;
    p.width = int(std::min<int64_t>(m_rows, 4));
    const Tile by_rows[3][5] = {
        {nullptr, tile_avx512<16, 1>, nullptr, nullptr, nullptr},
        {nullptr, tile_avx512<8, 1>, tile_avx512<8, 2>, nullptr, nullptr},
        {nullptr, tile_avx512<4, 1>, tile_avx512<4, 2>, tile_avx512<4, 3>, tile_avx512<4, 4>}};
    const Tile single[5] = {nullptr, tile_avx512<1, 1>, tile_avx512<1, 2>, tile_avx512<1, 3>, tile_avx512<1, 4>};
    for (int m = 0; m < 5; ++m) {
      p.tiles[m] = by_rows[p.rows == 16 ? 0 : p.rows == 8 ? 1 : 2][m];
      p.single[m] = single[m];
    }
  } else if (isa == "avx2" && has_avx2()) {
    p.rows = 1;
    p.width = int(std::min<int64_t>(m_rows, 4));
    const Tile tiles[5] = {nullptr, tile_avx2<1, 1>, tile_avx2<1, 2>, tile_avx2<1, 3>, tile_avx2<1, 4>};
    for (int m = 0; m < 5; ++m) p.tiles[m] = p.single[m] = tiles[m];
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

""" + AMX_SOURCE + r"""
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
  const bool wide = __builtin_cpu_supports("avx512f");
  std::atomic<int64_t> total{0};
  at::parallel_for(0, lines, 4096, [&](int64_t a, int64_t b) {
    total += wide ? read_lines_avx512(p + a * 64, b - a) : read_lines_scalar(p + a * 64, b - a);
  });
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
  const int64_t m_rows = x.size(0), n = w.size(0), k = w.size(1), x_stride = x.stride(0);
  const Plan p = plan_for(isa, std::max<int64_t>(m_rows, 1));
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
"""


RANK = {"avx2": 0, "avx512_bf16": 1, "amx_bf16": 2}  # each path needs what the ones below it need


@dataclass(frozen=True)
class GemvKernel:
    """The loaded library and the instruction path it runs (`isa`: amx_bf16, avx512_bf16 or avx2)."""

    library: object
    isa: str

    @property
    def direct_rows(self) -> int:
        """Rows of x up to which the kernel beats F.linear, measured (BENCHMARKS.md): AMX's tiles take 16
        rows for the price of one; the dot-product paths lose to F.linear above 2 rows."""
        return MAX_ROWS if self.isa == "amx_bf16" else 2

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous, M <= MAX_ROWS), weight [N, K] bf16 contiguous -> [M, N] bf16."""
        return self.library.gemv(x, weight, self.isa)

    def stream_read(self, buf: torch.Tensor) -> int:
        """Read every whole 64-byte line of `buf` (contiguous) once with vector loads, on the torch
        threads; returns a checksum. The benchmarks' second memory-bandwidth figure, beside `sum`."""
        return self.library.stream_read(buf)


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_for(cpu_flags: set[str]) -> str | None:
    """The instruction path these /proc/cpuinfo flags allow: amx_bf16, avx512_bf16, avx2, or None."""
    if {"amx_bf16", "amx_tile", "avx512_bf16", "avx512bw"} <= cpu_flags:
        return "amx_bf16"
    if {"avx512_bf16", "avx512bw"} <= cpu_flags:
        return "avx512_bf16"
    if {"avx2", "fma"} <= cpu_flags:
        return "avx2"
    return None


def load(cpu_flags: set[str], isa: str | None = None, build_dir: str | None = None) -> GemvKernel | str:
    """The kernel for this CPU (built on first use, then cached), or a one-line reason why not.

    `isa` forces a path (the benchmark compares them; None: the best the flags allow). `build_dir`:
    where to build (None: torch's extensions directory; tests pass a fresh one to see a build fail).
    Never raises: a CPU without the instructions, no compiler or a failed build all give the reason,
    which the caller logs once.
    """
    best = isa_for(cpu_flags)
    wanted = isa or best
    if best is None or RANK[wanted] > RANK[best]:
        return f"the CPU lacks {wanted or 'AVX2 + FMA'}"
    kernel = _build(build_dir, wanted)
    if isinstance(kernel, str) and isa is None and wanted == "amx_bf16" and kernel.startswith("the CPU lacks"):
        return _build(build_dir, "avx512_bf16")  # the OS did not grant AMX's tile state: the dot products
    return kernel


@functools.cache  # one build (or one failure) per directory and path, per process
def _build(build_dir: str | None, isa: str) -> GemvKernel | str:
    library = build_inline(NAME, _SOURCE, ["gemv", "best_isa", "stream_read"], "the kernel", build_dir)
    if isinstance(library, str):  # F.linear it is
        return library
    best = library.best_isa()  # what the CPU (and for AMX, the OS) really grants, beside what the flags said
    if not best or RANK[isa] > RANK[best]:
        return f"the CPU lacks {isa}"
    return GemvKernel(library, isa)


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_gemv --build`: build (or find in torch's cache) the kernel for this CPU
    and say which path it got, or why none; scripts/setup runs it so that no server start compiles."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cairn.ops.cpu_gemv", description="Build cairn's CPU gemv kernel.")
    parser.add_argument("--build", action="store_true", required=True, help="build it now (or find it built)")
    parser.parse_args(argv)
    kernel = load(cpu_flags())
    got = kernel.isa if isinstance(kernel, GemvKernel) else f"none ({kernel})"
    print(f"cairn gemv kernel: {got}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
