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
- avx2: no bf16 dot product, so fp32 FMAs (`_mm256_fmadd_ps`), in the outer-product form GEMM
  micro-kernels use, on a packed weight: `pack` re-lays a weight once, at load time, into blocks of 16
  output rows, [ceil(N / 16), K, 16], so that one 256-bit load of a block's 16 weights at one k splits
  by one shift and one mask into its two halves' outputs as fp32 vectors; each row of x then adds one
  broadcast x[m, k] and two FMAs (`gemv_packed`, `GemvKernel.packed`). Per k one weight load serves
  every row of the tile, and x is read once per 16 outputs: 4 blocks side by side at one row of x (8
  independent chains, 4 prefetched streams), 3 x 2 rows, 2 x 3, and 1 block in passes of up to 6 rows
  above. Each output is one sequential fp32 chain over k from 0, whatever the tile, the rows or the
  thread. Where it runs (CPUs without AVX-512), F.linear's bf16 is ATen's fallback GEMM, and the kernel
  takes every row: decode batches and a prefill. The row-major dot-product kernel of the earlier AVX2
  path (x widened to fp32 once per call, 8 weight rows side by side at one row of x, 4 at two, 2 in
  passes of up to four above) stays for a weight the layout does not re-lay (a tied lm_head). The same
  walk and tiles take an int8 weight (`--quantization int8`): `pack_int8` lays q [N, K] into the same
  blocks, 16 bytes per k in output order, each half sign-extended and converted to fp32 in registers
  (`gemv_int8_packed`, `GemvKernel.packed_int8`); an output's exact int8 x bf16 products sum in one fp32
  chain over k, times its row's scale, rounded to bf16 once. Half the bytes of bf16 to stream at one row.

Rows of W are split between the torch threads (`at::parallel_for`, ATen's OpenMP pool; on the AMX path
each thread takes the next blocks of 32 rows from a shared counter until none is left). Each output is
a fixed-order sum over its row alone, so it does not depend on how many rows x has, on the thread
count or on the other rows: decode and a short prefill piece compute a token's outputs bit for bit
alike. The result is rounded to bf16 once, like F.linear's (within bf16 rounding of it; tests compare).

What it is not: a GEMM. Above MAX_ROWS rows the caller keeps F.linear (prefill), except on the AVX2
path, where it calls the kernel MAX_ROWS rows at a time (`slices_prefill`; the packed kernel takes any
number of rows, but has no cache blocking over K for a long prefill). No bias. On a CPU
without AVX2 + FMA, without a C++ compiler, or where the build fails, `load()` returns None with the
reason, and the caller stays with F.linear.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cairn.ops import cpu_isa
from cairn.ops.cpu_build import build_command, build_inline
from cairn.ops.cpu_gemv_amx import AMX_SOURCE
from cairn.ops.cpu_gemv_avx2 import AVX2_SOURCE

MAX_ROWS = 16  # rows of x the kernel takes; more is a GEMM's job
PACK_BLOCK = 16  # output rows per block of the AVX2 path's packed weight (`pack`)
NAME = "cairn_cpu_gemv7"  # torch caches builds by name: a new kernel source gets a new name
FUNCTIONS = ["gemv", "gemv_packed", "gemv_int8_packed", "best_isa", "stream_read"]  # what the library exports

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
""" + AVX2_SOURCE + r"""
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

"""




@dataclass(frozen=True)
class GemvKernel:
    """The loaded library and the instruction path it runs (`isa`: amx_bf16, avx512_bf16 or avx2)."""

    library: object
    isa: str

    @property
    def direct_rows(self) -> int:
        """Rows of x the kernel takes directly, on every path: MAX_ROWS. Each output is a fixed-order sum over its
        own row, so a token's outputs are the same bits alone and in a decode batch of up to 16 (above, a prefill:
        F.linear, or the kernel MAX_ROWS rows at a time on the AVX2 path). Measured (BENCHMARKS.md, gemv_bench.py):
        AMX's tiles take 16 rows for the price of one; on a Zen 4 the AVX512-BF16 dot products beat oneDNN's
        F.linear at every row count from 1 to 16 (20.8 against 11.0 GB/s at 1 row, 9.7 against 8.2 at 16); the
        AVX2 path runs where F.linear's bf16 is ATen's fallback GEMM, which it beats at every row count."""
        return MAX_ROWS

    @property
    def slices_prefill(self) -> bool:
        """Whether the layout runs a prefill's rows through the kernel too, MAX_ROWS at a time, rather than
        F.linear: on the AVX2 path, which runs where F.linear's bf16 is ATen's fallback GEMM (measured
        BENCHMARKS.md, the AVX2-only pass)."""
        return self.isa == "avx2"

    @property
    def packs(self) -> bool:
        """Whether this path multiplies a packed weight (`pack`, `packed`): the AVX2 path's outer-product form.
        The AMX and AVX512-BF16 paths take the weight as loaded."""
        return self.isa == "avx2"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous, M <= MAX_ROWS), weight [N, K] bf16 contiguous -> [M, N] bf16."""
        return self.library.gemv(x, weight, self.isa)

    def packed(self, x: torch.Tensor, packed: torch.Tensor, n: int,
               tile: tuple[int, int] | None = None) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous, any M) against `pack(weight)` of a weight [n, K] -> [M, n] bf16.
        `tile` (blocks of 16 outputs side by side, rows of x per pass) forces a tile, for the benchmark;
        each output's bits are the same under any tile."""
        nb, mt = tile or (0, 0)
        return self.library.gemv_packed(x, packed, n, nb, mt)

    def packed_int8(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int,
                    tile: tuple[int, int] | None = None) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous, any M) against `pack_int8(q)` of an int8 weight q [n, K], times the
        output rows' bf16 scales [n] -> [M, n] bf16. `tile` as in `packed`."""
        nb, mt = tile or (0, 0)
        return self.library.gemv_int8_packed(x, packed, scales, n, nb, mt)

    def stream_read(self, buf: torch.Tensor) -> int:
        """Read every whole 64-byte line of `buf` (contiguous) once with vector loads, on the torch
        threads; returns a checksum. The benchmarks' second memory-bandwidth figure, beside `sum`."""
        return self.library.stream_read(buf)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The AVX2 path's layout of a bf16 weight [N, K]: [ceil(N / 16), K, 16], block b holding for each k the
    weights of outputs 16b..16b+15, output 16b+i at element 2i and 16b+8+i at 2i+1 (so that one 256-bit
    load splits into the two halves' fp32 vectors); rows past N are zeros. One new tensor (plus a padded
    copy of the weight when N is not a multiple of 16)."""
    w = _whole_blocks(weight)
    blocks, k = w.shape[0] // PACK_BLOCK, w.shape[1]
    return w.reshape(blocks, 2, PACK_BLOCK // 2, k).permute(0, 3, 2, 1).contiguous().view(blocks, k, PACK_BLOCK)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """The AVX2 path's layout of an int8 weight [N, K]: [ceil(N / 16), K, 16], block b holding for each k the
    weights of outputs 16b..16b+15 in that order; rows past N are zeros. One new tensor."""
    w = _whole_blocks(q)
    return w.reshape(-1, PACK_BLOCK, w.shape[1]).transpose(1, 2).contiguous()


def _whole_blocks(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (detached), with zero rows added up to a whole number of PACK_BLOCK-row blocks."""
    w = weight.detach()
    short = -w.shape[0] % PACK_BLOCK
    return torch.nn.functional.pad(w, (0, 0, 0, short)) if short else w


def load(cpu_flags: set[str], isa: str | None = None, build_dir: str | None = None,
         machine: str | None = None) -> GemvKernel | str:
    """The kernel for this CPU (built on first use, then cached), or a one-line reason why not.

    `isa` forces a path (cpu_isa.PATHS; None: the best the flags allow); `machine` is platform.machine()'s
    answer (None: this one's; the tests fake another). `build_dir`: where to build (None: torch's extensions
    directory; tests pass a fresh one to see a build fail). Never raises: a CPU without the instructions (or not
    an x86 one: nothing is built there), no compiler or a failed build all give the reason, which the caller
    logs once.
    """
    best = cpu_isa.best_path(cpu_flags, machine)
    wanted = isa or best
    if wanted == "none" or _rank(wanted) > _rank(best):
        if not cpu_isa.is_x86(machine):
            return "not an x86 CPU (the kernel is x86 C++)"
        return "the path none runs no compiled op" if isa == "none" else f"the CPU lacks {_needs(wanted)}"
    kernel = _build(build_dir, wanted)
    if isinstance(kernel, str) and isa is None and wanted == "amx_bf16" and kernel.startswith("the CPU lacks"):
        return _build(build_dir, "avx512_bf16")  # the OS did not grant AMX's tile state: the dot products
    return kernel


def _rank(path: str) -> int:
    return cpu_isa.PATHS.index(path)


def _needs(path: str) -> str:
    return "AVX2 + FMA" if path == "none" else path


@functools.cache  # one build (or one failure) per directory and path, per process
def _build(build_dir: str | None, isa: str) -> GemvKernel | str:
    library = build_inline(NAME, _SOURCE, FUNCTIONS, "the kernel", build_dir)
    if isinstance(library, str):  # F.linear it is
        return library
    best = library.best_isa() or "none"  # what the CPU (and for AMX, the OS) really grants, beside the flags
    if _rank(isa) > _rank(best):
        return f"the CPU lacks {isa}"
    return GemvKernel(library, isa)


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_gemv --build` (cpu_build.build_command): the path the kernel got on this CPU, or
    why none."""
    def built() -> str:
        kernel = load(cpu_isa.cpu_flags())
        return kernel.isa if isinstance(kernel, GemvKernel) else f"none ({kernel})"

    return build_command(argv, "cpu_gemv", "gemv kernel", built)


if __name__ == "__main__":
    raise SystemExit(main())
