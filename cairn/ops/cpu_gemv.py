"""A bf16 gemv for CPU decode: y = x W^T for a few rows x, streaming W once at memory speed.

What it is: a small C++ kernel (cairn/ops/csrc/gemv.cpp, its AVX2 and AMX paths in gemv_avx2.h and gemv_amx.h)
built on first use by cpu_build (cached by torch under its extensions directory, so a machine compiles it
once). Per output row it keeps fp32 accumulators and reads the row's weights once for every row of x (up to
MAX_ROWS); its three instruction paths, the best the CPU has chosen once when the library loads:

- amx_bf16: AMX tiles (`_tile_dpbf16ps`): 16 weight rows x 32 bf16 as they lie in memory against x
  packed into AMX's pair layout and zero-padded to 16 rows, so one instruction serves every row of x
  and a call at 1 row runs the same instructions as one at 16; 32 weight rows per step, each prefetched
  256 bytes ahead. Its outputs equalled F.linear's (oneDNN's AMX kernel) bit for bit on the shapes
  tried. Linux must grant the process the tile state (arch_prctl); where it does not, the kernel takes
  the AVX512-BF16 path;
- avx512_bf16: `_mm512_dpbf16_ps`, 32 bf16 products per instruction; on Intel 16 weight rows streamed side by
  side for one row of x (8 for two, 4 above), each stream with a software prefetch 256 bytes ahead; on AMD
  (Zen 4 reads one stream per core at full bandwidth) one weight row at a time up to 8 rows of x;
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
from cairn.ops.cpu_build import CppSource, build, build_command

MAX_ROWS = 16  # rows of x the kernel takes; more is a GEMM's job
PACK_BLOCK = 16  # output rows per block of the AVX2 path's packed weight (`pack`)
NAME = "cairn_cpu_gemv7"  # the build's name adds a hash of the C++ (cpu_build): a new source, a new build
# its C++, in csrc/: gemv.cpp (the AVX512-BF16 path, the entry points it exports) including the other paths
CPP = CppSource(NAME, "gemv.cpp", "the kernel", headers=("gemv_avx2.h", "gemv_amx.h"))


@dataclass(frozen=True)
class GemvKernel:
    """The loaded library and the instruction path it runs (`isa`: amx_bf16, avx512_bf16 or avx2)."""

    library: object
    isa: str

    @property
    def direct_rows(self) -> int:
        """Rows of x the kernel takes directly, on every path: MAX_ROWS. Each output is a fixed-order sum over its
        own row, so a token's outputs are the same bits alone and in a decode batch of up to 16 (above, a prefill:
        F.linear, or the kernel MAX_ROWS rows at a time on the AVX2 path). Measured: AMX's tiles take 16 rows for
        the price of one (docs/kernels.md); on a Zen 4 the AVX512-BF16 dot products beat oneDNN's F.linear at every
        row count from 1 to 16 (gemv_bench.py: 20.8 against 11.0 GB/s at 1 row, 9.7 against 8.2 at 16); the AVX2
        path runs where F.linear's bf16 is ATen's fallback GEMM, which it beats at every row count
        (docs/kernels.md)."""
        return MAX_ROWS

    @property
    def slices_prefill(self) -> bool:
        """Whether the layout runs a prefill's rows through the kernel too, MAX_ROWS at a time, rather than
        F.linear: on the AVX2 path, which runs where F.linear's bf16 is ATen's fallback GEMM (measured:
        BENCHMARKS.md, "Decode speed in bf16", prefill 512 on Zen 3 against `plain`)."""
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
    library = build(CPP, build_dir)
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
