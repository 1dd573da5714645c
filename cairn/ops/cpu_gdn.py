"""A fused Gated DeltaNet decode step for CPU (bf16 models): conv update, gating, delta rule, gated norm.

What it is: one C++ op (cairn/ops/csrc/gdn.cpp, built on first use by cpu_build and cached by torch
like cairn/ops/cpu_gemv.py) that does for a batch of decode tokens what GatedDeltaNet.forward does
between in_proj and out_proj with the reference kernels:

    conv window <- [conv state | x]; x' = silu(sum of taps)     (q k v channels, state updated in place)
    beta = sigmoid(b); decay = exp(-exp(A_log) * softplus(a + dt_bias))
    q, k = l2norm(q) * Dk**-0.5, l2norm(k); one delta-rule step on the fp32 state (updated in place)
    out = rmsnorm(o) * weight * silu(z)

in one parallel region of the torch threads, a task per (sequence, key head): its q / k channels' and its
value heads' conv update, then those heads' step, with no intermediate tensors: the reference runs
about 60 small ATen calls per layer for this. The conv update and the per-head step are compiled for
AVX-512 (16-wide, FMA; the silus with libtorch's vectorised exp, cairn/ops/csrc/vec.h), for AVX2 + FMA
(8-wide, the same with libtorch's 8-wide exp) and for the baseline x86-64 (std::exp), the CPU picking one
(`vector_body()` says which); on AVX2 the conv of a 4-tap layer with contiguous state rows (the Qwen hybrids')
takes 8 channels per vector instead of one at a time (`conv4_block8`, the same bits; the AVX-512 body keeps the
channel-at-a-time conv, not measured on such a CPU); each reads its fp32 state from memory once and writes
it once (at batch 16 of the 0.8B shape, 576 MB per step: the step's largest traffic after the weights).
Rounding follows the reference's where it rounds to bf16
(conv products and output, beta, o, the normed o and its product with the weight), so the two agree
within bf16 rounding (tests/test_cpu_gdn.py); it is not bit-identical to the reference, so warm and
cold runs must both take it for decode tokens, which they do (one decode path).

What it is not: a prefill kernel (prefill keeps the chunked reference), nor for fp32 / fp16 models.
`load()` returns the op, or a one-line reason why not (no compiler, a failed build), and the layer
then keeps the reference path.
"""

from __future__ import annotations

import functools
import logging

import torch

from cairn.ops import cpu_isa
from cairn.ops.cpu_build import CppSource, build, build_command, built_or_why

log = logging.getLogger(__name__)

NAME = "cairn_cpu_gdn8"  # the build's name adds a hash of the C++ (cpu_build): a new source, a new build

# its C++, in csrc/
CPP = CppSource(NAME, "gdn.cpp", "the fused GDN decode op", headers=("vec.h",))


@functools.cache  # one build (or one failure) per directory, per process
def _library(build_dir: str | None):
    return build(CPP, build_dir)


def load(build_dir: str | None = None):
    """The built op (a callable with gdn_decode's signature), or a one-line reason why not.

    `build_dir`: where to build (None: torch's extensions directory). Never raises."""
    library = _library(build_dir)
    return library if isinstance(library, str) else library.gdn_decode


def vector_body(path: str) -> str | None:
    """The body the op runs on this CPU on instruction path `path` (cpu_isa.PATHS): "avx512", "avx2" or "generic";
    None where it does not build."""
    library = _library(None)
    return None if isinstance(library, str) else library.vector_body(cpu_isa.body(path))


@functools.cache  # loaded (or refused) once per process and path, and said so in one line
def _loaded(path: str):
    op = load()
    if not callable(op):
        log.warning("Gated DeltaNet decode: the reference kernels (%s)", op)
        return None
    log.info("Gated DeltaNet decode: cairn's fused CPU op (conv update, gating, delta rule, gated norm; %s body)",
             vector_body(path))
    max_body = cpu_isa.body(path)
    return lambda *args: op(*args, max_body)


def load_once(path: str) -> bool:
    """Load (build, or find in torch's cache) and check the op now, once per process; whether bf16 on CPU will
    run it on `path` (else the reference, said so in one line)."""
    return _loaded(path) is not None


def op_for(*tensors_and_path):
    """The fused op for a decode batch on instruction path `path`, the last argument (cpu_isa.PATHS), given its
    in_proj output and the layer's conv weight, A_log, dt_bias and norm weight; or None (the reference path):
    taken when all are bf16 on CPU and the op builds (`Kernels.gdn_decode_op`, a CpuOp that passes the path; the
    first call builds or loads it). The op takes gdn_decode's arguments without max_body (the path gives it)."""
    *tensors, path = tensors_and_path
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return None
    return _loaded(path)


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_gdn --build` (cpu_build.build_command)."""
    return build_command(argv, "cpu_gdn", "fused GDN decode op", lambda: built_or_why(load()))


if __name__ == "__main__":
    raise SystemExit(main())
