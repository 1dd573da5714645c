"""The SwiGLU activation for CPU (bf16 models): silu(gate) * up in one pass, ATen's bits.

What it is: one C++ op (cairn/ops/csrc/silu.cpp, built on first use by cpu_build and cached by torch like
cairn/ops/cpu_norm.py) that turns a bf16 [rows, 2 * inner] gate_up row ([gate | up]) into bf16(bf16(silu(gate)) *
up), what the reference (cairn/ops/activation.py) does in two ATen calls with a tensor between them (with the
chunk, three calls a layer and about 100 us of a decode step's CPU each). On AVX-512 (16 lanes)
and on AVX2 + FMA (8 lanes; the widest the instruction path allows, cairn/ops/cpu_isa.py: `vector_body(path)`
says which) it computes the silu with libtorch's own vectorised exp, the one ATen's vectorised code calls on that
CPU, in ATen's formula (cairn/ops/csrc/vec.h), and rounds where ATen rounds, so it gives the reference's bits;
that is checked once when it loads, on every bf16 value (the silu's input is bf16: 65,536 cases), and where it
does not hold the reference is used (one log line). One exception, ATen's own: subnormal values follow the
subnormal mode of the thread that computes them (`torch.set_flush_denormal` sets it for the calling thread and
threads created later), and above one thread's grain ATen and this op split the work differently; so on
prefill-sized inputs a subnormal gate (|x| < 1.2e-38) may come out flushed in one and not the other. Decode rows run on
the calling thread in both: the same bits. An earlier scalar build of this op was slower than ATen's two
vectorised calls and was not kept.

What it is not: for fp32 / fp16 models (the reference), nor the MoE experts' activations (their own loops).
`load()` returns the module, or a one-line reason why not.
"""

from __future__ import annotations

import functools
import logging

import torch

from cairn.ops import activation, cpu_isa
from cairn.ops.cpu_build import CppSource, build, build_command, built_or_why

log = logging.getLogger(__name__)

NAME = "cairn_cpu_silu4"  # the build's name adds a hash of the C++ (cpu_build): a new source, a new build

CPP = CppSource(NAME, "silu.cpp", "the fused silu * up op", headers=("vec.h",),
                extra_cflags=("-ffp-contract=off",))  # its C++, in csrc/


@functools.cache  # one build (or one failure) per directory, per process
def load(build_dir: str | None = None):
    """The built module (`silu_mul`), or a one-line reason why not. Never raises."""
    return build(CPP, build_dir)


def vector_body(path: str) -> str | None:
    """The body the op runs on this CPU on instruction path `path` (cpu_isa.PATHS): "avx512", "avx2" or "generic";
    None where it does not build."""
    library = load()
    return None if isinstance(library, str) else library.vector_body(cpu_isa.body(path))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are equal bit for bit, but for NaNs, which need only be NaN alike (their payloads may differ)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def gives_reference_bits(op) -> bool:
    """The op (gate_up -> silu(gate) * up) gives the reference's outputs for every bf16 gate value, against an up
    of 1 and a random one.

    Both run on this thread (slices of 16,384 gates: below ATen's parallel grain), since the threads of a
    process may differ in their subnormal mode: `torch.set_flush_denormal` (which the engine sets) changes the
    calling thread's and those created after it, not the worker threads already running."""
    gate = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.randn(gate.shape[0], generator=torch.Generator().manual_seed(0)).bfloat16()
    for u in (torch.ones_like(up), up):
        for g, v in zip(gate.split(SLICE), u.split(SLICE), strict=True):
            gate_up = torch.cat([g, v]).view(1, -1)
            if not same_bits(op(gate_up), activation.silu_mul(gate_up)):
                return False
    return True


SLICE = 16384  # gates per check call: one thread for ATen's elementwise ops (their grain is 32,768 elements)


@functools.cache  # loaded (or refused) once per process and path, and said so in one line
def _loaded(path: str):
    """The op on `path` as a call gate_up [rows, 2 * inner] -> [rows, inner], or None (the reference)."""
    library = load()
    if isinstance(library, str):
        log.warning("MLP silu(gate) * up: the reference (%s)", library)
        return None
    max_body, fn = cpu_isa.body(path), library.silu_mul

    def op(gate_up: torch.Tensor) -> torch.Tensor:
        return fn(gate_up, max_body)
    if not gives_reference_bits(op):
        log.warning("MLP silu(gate) * up: the reference (the fused op's %s body does not give ATen's bits on this "
                    "CPU)", vector_body(path))
        return None
    log.info("MLP silu(gate) * up: cairn's fused CPU op (ATen's bits; %s body)", vector_body(path))
    return op


def load_once(path: str) -> bool:
    """Load (build, or find in torch's cache) and check the op now, once per process; whether bf16 on CPU will
    run it on `path` (else the reference, said so in one line)."""
    return _loaded(path) is not None


def silu_mul(gate_up: torch.Tensor, path: str) -> torch.Tensor:
    """activation.silu_mul's contract and bits, through the C++ op on instruction path `path` (cpu_isa.PATHS) for
    bf16 on CPU (the reference otherwise, or when the op does not build or does not reproduce ATen's bits here).
    `Kernels.silu_mul` is a CpuOp that passes the path."""
    op = _loaded(path) if gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu" else None
    if op is None or gate_up.stride(-1) != 1:
        return activation.silu_mul(gate_up)
    if gate_up.dim() == 2:  # a decode step's rows, as they are (no reshape and view: ~1 us each)
        return op(gate_up)
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    return op(rows).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def bound_silu_mul(path: str):
    """silu_mul on `path` as one pre-bound call for a decode plan (cairn/model/decode_plan.py): the op itself,
    taking bf16 CPU gate_up rows [n, 2 * inner] with contiguous last dimension; None where silu_mul would take the
    reference (the op not loaded)."""
    return _loaded(path)


def main(argv: list[str] | None = None) -> int:
    """`python -m cairn.ops.cpu_silu --build` (cpu_build.build_command)."""
    return build_command(argv, "cpu_silu", "fused silu * up op", lambda: built_or_why(load()))


if __name__ == "__main__":
    raise SystemExit(main())
