"""A fused residual add + RMSNorm for CPU (bf16 models): x + delta and rms_norm(x + delta) in one pass.

What it is: one C++ op (cairn/ops/csrc/norm.cpp, built on first use by cpu_build and cached by torch like
cairn/ops/cpu_gdn.py) that does per row of a bf16 [..., D] tensor what the reference does in
about ten ATen calls (cairn/ops/norm.py: the bf16 add, then float, pow, mean, add eps, rsqrt, two
products and the cast back), with no intermediate tensors (rows spread over the torch threads when
there are many: prefill).

It rounds exactly where the reference does (the sum to bf16 once, the normed product to bf16 once) and
sums the squares in the order ATen's float sum takes over a contiguous row (its cascade of four
accumulator rows of CPU vectors; the vector width is found at load by comparing with torch's own sum:
8 floats on this Xeon although torch reports AVX512), so its outputs are the reference's bit for bit
(tests/test_cpu_norm.py) and the residual stream is the same whichever path a row takes. Where no width
reproduces ATen's sum, the reference is used (one log line). The same library holds the attention layer's
input op, `norm_rotary_write` (q / k norms, rotary and the KV writes, the reference's bits:
cairn/ops/csrc/norm_rotary.h; attention.py holds its reference).

What it is not: an fp32 / fp16 kernel (those keep the reference), nor the gated norm of Gated DeltaNet
(inside cpu_gdn's op). `load()` returns the module, or a one-line reason why not, and the model then
keeps the reference with one log line.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from cairn.ops import attention, norm
from cairn.ops.cpu_build import CppSource, build, build_command, built_or_why

log = logging.getLogger(__name__)

NAME = "cairn_cpu_norm2"  # the build's name adds a hash of the C++ (cpu_build): a new source, a new build

CPP = CppSource(NAME, "norm.cpp", "the fused add + RMSNorm op", headers=("norm_rotary.h",),
                extra_cflags=("-ffp-contract=off",))  # its C++, in csrc/


@functools.cache  # one build (or one failure) per directory, per process
def load(build_dir: str | None = None):
    """The built module (`rms_norm`, `add_rms_norm`, `row_sums`, `norm_rotary_write`), or a one-line reason why
    not. Never raises."""
    return build(CPP, build_dir)


CANDIDATE_LANES = (8, 16, 4)  # floats per vector of ATen's CPU sum: AVX2, AVX-512, 128-bit builds


def find_lanes(library) -> int | None:
    """The vector width for which the op's sum of squares is ATen's float sum bit for bit, on rows of
    several lengths (the order depends on how ATen's kernels were built for this CPU), or None."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(16, n, generator=gen).bfloat16().float().pow(2) for n in (5, 20, 100, 256, 1024, 4099)]
    for lanes in dict.fromkeys(CANDIDATE_LANES):
        if all(torch.equal(library.row_sums(r, lanes), r.sum(-1)) for r in rows):
            return lanes
    return None


@dataclass(frozen=True)
class _Op:
    library: object  # the built module
    lanes: int  # its sums' vector width, the one that reproduces ATen's


@functools.cache  # loaded (or refused) once per process, and said so in one line
def _loaded() -> _Op | None:
    library = load()
    if isinstance(library, str):
        log.warning("RMSNorm: the reference (%s)", library)
        return None
    lanes = find_lanes(library)
    if lanes is None:
        log.warning("RMSNorm: the reference (the fused op's sums are not ATen's bit for bit on this CPU)")
        return None
    log.info("RMSNorm: cairn's fused CPU op (residual add + norm in one pass; ATen's sum order, %d lanes)", lanes)
    return _Op(library, lanes)


def load_once() -> bool:
    """Load (build, or find in torch's cache) and check the op now, once per process; whether bf16 on CPU will
    run it (else the reference, said so in one line)."""
    return _loaded() is not None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """norm.add_rms_norm's contract and bits, through the C++ op for bf16 on CPU (the reference otherwise,
    or when the op does not build or cannot reproduce ATen's sum here). x and delta are [..., D] with
    contiguous, evenly spaced rows (a strided view of heads is fine); the results are new contiguous tensors."""
    op = _loaded() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
    if op is None:
        return norm.add_rms_norm(x, delta, weight, eps, zero_centred)
    if delta is None:
        return x, op.library.rms_norm(x, weight, eps, zero_centred, op.lanes)
    return op.library.add_rms_norm(x, delta, weight, eps, zero_centred, op.lanes)


def bound_add_rms_norm(weight: torch.Tensor, eps: float, zero_centred: bool):
    """add_rms_norm of this norm's weight as one pre-bound call, `(x, delta | None) -> (x + delta, normed)` on
    bf16 CPU rows as add_rms_norm takes them, for a decode plan (cairn/model/decode_plan.py); None where
    add_rms_norm would take the reference (not bf16 on CPU, the op not loaded). The same op and arguments as
    add_rms_norm's: the same bits."""
    op = _loaded() if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" else None
    if op is None:
        return None
    add, norm_only, lanes = op.library.add_rms_norm, op.library.rms_norm, op.lanes

    def call(x: torch.Tensor, delta: torch.Tensor | None):
        if delta is None:
            return x, norm_only(x, weight, eps, zero_centred, lanes)
        return add(x, delta, weight, eps, zero_centred, lanes)
    return call


def norm_rotary_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, zero_centred: bool, cos: torch.Tensor, sin: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """attention.norm_rotary_write's contract and bits, through one C++ op for bf16 on CPU
    (cairn/ops/csrc/norm_rotary.h; the reference otherwise, or when the op does not build or cannot
    reproduce ATen's sum here)."""
    op = _loaded() if q.dtype == torch.bfloat16 and q.device.type == "cpu" else None
    if op is None or q_weight.dtype != k_weight.dtype:
        return attention.norm_rotary_write(q, k, v, q_weight, k_weight, eps, zero_centred, cos, sin, k_pool, v_pool,
                                           slot_mapping)
    return op.library.norm_rotary_write(q, k, v, q_weight, k_weight, eps, zero_centred, cos, sin, k_pool, v_pool,
                                        slot_mapping, op.lanes)


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_norm --build` (cpu_build.build_command)."""
    return build_command(argv, "cpu_norm", "fused add + RMSNorm op", lambda: built_or_why(load()))


if __name__ == "__main__":
    raise SystemExit(main())
