"""Paged decode attention for CPU (bf16 models): one C++ op reading each sequence's keys and values in place.

What it is: one C++ op (cairn/ops/csrc/attention.cpp, built on first use by cpu_build and cached by torch like
cairn/ops/cpu_silu.py) with the contract of `attention.paged_decode_attention`: one new query token per
sequence, q [B, H, D], over its first context_lens[b] positions in a paged pool [pages, page_size, KV heads, D],
found through its page table. The reference gathers each sequence's pages into a padded batch (a copy, unless
one sequence's pages are consecutive) and calls SDPA, whose CPU kernel, in bf16 on a CPU without bf16
arithmetic, runs about ten times slower than in fp32 and expands K and V for grouped queries (docs/kernels.md:
12 ms per layer at 4k tokens of context, 127 ms at 32k). The op reads every key and value once, from its page,
for all the query heads of its group:

    for each (sequence b, KV head, part of PART = 256 positions)      one task of the parallel region
        s[g, t] = (q[b, g] . k[t]) * scale                     fp32 sums, for the group's query heads g
        m[g] = max_t s[g, t];  l[g] = sum_t exp(s[g, t] - m[g]);  acc[g] = sum_t exp(s[g, t] - m[g]) v[t]
    out[b, g] = sum_parts exp(m_p - M) acc_p / sum_parts exp(m_p - M) l_p,   M = max_parts m_p   (rounded to bf16)

The parts are fixed runs of positions and are combined in order, so a sequence's output is the same bits whatever
the thread count and whichever other sequences share the call (a sequence decoded alone and in a batch are
alike). The body is compiled for AVX2 + FMA (8-wide; exp with libtorch's vectorised one, cairn/ops/csrc/vec.h),
which AVX-512 CPUs run too, and for the baseline x86-64 (std::exp); `vector_body()` says which runs. It is
not bit-identical to SDPA (another order of sums; tests/test_cpu_attention.py bounds the difference against
an fp64 computation), so warm and cold runs must both take it for decode tokens, which they do: decode tokens
have one path, and with --prefill-block nothing a decode step computed is kept for resuming.

What it is not: a prefill kernel (prefill keeps the reference's SDPA), nor for fp32 / fp16 models.
`load()` returns the module, or a one-line reason why not, and decode then keeps the reference.
"""

from __future__ import annotations

import functools
import logging

import torch

from cairn.ops import attention, cpu_isa
from cairn.ops.cpu_build import CppSource, build, build_command, built_or_why

log = logging.getLogger(__name__)

NAME = "cairn_cpu_attention8"  # the build's name adds a hash of the C++ (cpu_build): a new source, a new build

CPP = CppSource(NAME, "attention.cpp", "the paged decode attention op", headers=("vec.h",),
                extra_cflags=("-ffp-contract=off",))  # its C++, in csrc/


@functools.cache  # one build (or one failure) per directory, per process
def load(build_dir: str | None = None):
    """The built module (`paged_decode`, `vector_body`), or a one-line reason why not. Never raises."""
    return build(CPP, build_dir)


def vector_body(head_dim: int, path: str) -> str | None:
    """The body the op runs on this CPU for heads of head_dim on instruction path `path` (cpu_isa.PATHS): "avx2" or
    "generic"; None where it does not build."""
    library = load()
    return None if isinstance(library, str) else library.vector_body(head_dim, cpu_isa.body(path))


@functools.cache  # loaded (or refused) once per process, and said so in one line
def _loaded():
    library = load()
    if isinstance(library, str):
        log.warning("decode attention: the reference, SDPA over gathered pages (%s)", library)
        return None
    log.info("decode attention: cairn's paged CPU op (keys and values read in place)")
    return library


def load_once() -> bool:
    """Load (build, or find in torch's cache) the op now, once per process; whether bf16 on CPU will run it (else
    the reference, said so in one line)."""
    return _loaded() is not None


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, path: str) -> torch.Tensor:
    """attention.paged_decode_attention's contract, through the C++ op on instruction path `path` (cpu_isa.PATHS)
    for bf16 on CPU (the reference otherwise, or when the op does not build). `Kernels.paged_decode_attention` is a
    CpuOp that passes the path."""
    on_cpu_bf16 = all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (q, k_pool, v_pool))
    library = _loaded() if on_cpu_bf16 and k_pool.is_contiguous() and v_pool.is_contiguous() else None
    if library is None:
        return attention.paged_decode_attention(q, k_pool, v_pool, page_tables, context_lens, scale)
    return library.paged_decode(q.contiguous(), k_pool, v_pool, page_tables.long().contiguous(),
                                context_lens.long().contiguous(), float(scale), cpu_isa.body(path))


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_attention --build` (cpu_build.build_command)."""
    return build_command(argv, "cpu_attention", "paged decode attention op", lambda: built_or_why(load()))


if __name__ == "__main__":
    raise SystemExit(main())
