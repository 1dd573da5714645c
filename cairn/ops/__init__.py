"""Kernels behind one interface, chosen once at start-up.

`select_kernels(device, fast, cpu_path)` returns a `Kernels` whose fields are the pure-PyTorch references in
this package (`REFERENCE`), on a CPU with cairn's compiled ops for instruction path `cpu_path`
(cairn/ops/cpu_isa.py; bf16 only: each op keeps the reference for other dtypes; `none`: no compiled op), or,
when asked for (`--fast-kernels`, off by default) on CUDA, a fast implementation with the same signature where
one is installed (cairn/ops/cuda.py: flash-linear-attention, causal-conv1d, FlashInfer). Fast kernels are
imported lazily and only then; nothing on a CPU machine imports triton, flash-linear-attention, causal-conv1d
or flashinfer, and nothing on a machine whose path is `none` (ARM, no compiler, or asked) builds a C++ op.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cairn.ops import activation, attention, conv, gdn, mamba2, norm

log = logging.getLogger(__name__)


@functools.cache
def _cpu_op(name: str):
    """Module cairn.ops.<name>, imported on first use: importing the package does not import the ops' modules,
    so that `python -m cairn.ops.cpu_gdn --build` runs it once, as __main__ only."""
    return importlib.import_module(f"cairn.ops.{name}")


@dataclass(frozen=True)
class CpuOp:
    """A Kernels field that runs one of cairn's compiled CPU ops on instruction path `path` (cpu_isa.PATHS): called
    with the reference's arguments, it calls `fn(*args, path)` (cpu_gdn.op_for, cpu_silu.silu_mul,
    cpu_attention.paged_decode_attention), which takes the op for bf16 on CPU and the reference otherwise. Equal
    CpuOps are the same op on the same path."""

    fn: Callable
    path: str

    def __call__(self, *args):
        return self.fn(*args, self.path)


def fused_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_norm.add_rms_norm (bf16 on CPU: one C++ op, the reference's bits; else the reference), imported
    on first use. The op has no instruction paths of its own: every path but none runs it."""
    return _cpu_op("cpu_norm").add_rms_norm(x, delta, weight, eps, zero_centred)


def fused_norm_rotary_write(*args):
    """cpu_norm.norm_rotary_write (bf16 on CPU: one C++ op, the reference's bits; else the reference), imported
    on first use like fused_add_rms_norm."""
    return _cpu_op("cpu_norm").norm_rotary_write(*args)


@dataclass(frozen=True)
class Kernels:
    """The kernel set a model runs with; each field documents its contract in its reference module."""

    name: str
    chunk_gated_delta_rule: Callable = gdn.chunk_gated_delta_rule
    recurrent_gated_delta_rule: Callable = gdn.recurrent_gated_delta_rule
    causal_conv1d: Callable = conv.causal_conv1d
    causal_conv1d_update: Callable = conv.causal_conv1d_update
    paged_prefill_attention: Callable = attention.paged_prefill_attention
    # one query token per sequence over its paged context (cairn/ops/attention.py: paged_decode_attention); on a CPU
    # path, bf16 through one C++ op that reads keys and values in place (cpu_attention.py: not the reference's bits)
    paged_decode_attention: Callable = attention.paged_decode_attention
    mamba_conv1d: Callable = mamba2.mamba_conv1d
    mamba_conv1d_update: Callable = mamba2.mamba_conv1d_update
    ssd_chunk_scan: Callable = mamba2.ssd_chunk_scan
    ssd_recurrent_step: Callable = mamba2.ssd_recurrent_step
    # x -> the fused Gated DeltaNet decode op for that batch, or None for the kernels above (on a CPU path, bf16:
    # cairn's C++ op, cairn/ops/cpu_gdn.py; the reference's value, None always, keeps the kernels above)
    gdn_decode_op: Callable = gdn.no_decode_op
    # (x, delta | None, weight, eps, zero_centred) -> (x + delta, rms_norm(x + delta)): the residual add and the
    # norm after it (cairn/ops/norm.py); on a CPU path, bf16 through one C++ op with the same bits (cpu_norm.py)
    add_rms_norm: Callable = norm.add_rms_norm
    # the gated attention's q / k norms, rotary and KV write (cairn/ops/attention.py: norm_rotary_write); on a CPU
    # path, bf16 through one C++ op with the same bits (cpu_norm.py, csrc/norm_rotary.h)
    norm_rotary_write: Callable = attention.norm_rotary_write
    # gate_up [..., 2 * inner] -> silu(gate) * up, SwiGLU's activation (cairn/ops/activation.py); on a CPU path, bf16
    # through one C++ op with ATen's bits (cpu_silu.py)
    silu_mul: Callable = activation.silu_mul


REFERENCE = Kernels(name="reference")


def cpu_kernels(path: str) -> Kernels:
    """The reference kernels with cairn's compiled CPU ops on instruction path `path` (cpu_isa.PATHS) in the fields
    they serve; `none`: the references alone. Each op keeps the reference for other dtypes and devices."""
    if path == "none":
        return REFERENCE
    cpu_attention, cpu_gdn, cpu_silu = (_cpu_op(name) for name in ("cpu_attention", "cpu_gdn", "cpu_silu"))
    return dataclasses.replace(
        REFERENCE, name=f"reference+cpu[{path}]", paged_decode_attention=CpuOp(cpu_attention.paged_decode_attention,
                                                                           path),
        gdn_decode_op=CpuOp(cpu_gdn.op_for, path), add_rms_norm=fused_add_rms_norm,
        norm_rotary_write=fused_norm_rotary_write, silu_mul=CpuOp(cpu_silu.silu_mul, path))


def is_cpu_op(fn: Callable) -> bool:
    """Whether a Kernels field value is one of cairn's compiled CPU ops (cpu_kernels), not a reference or a CUDA one."""
    return isinstance(fn, CpuOp) or fn is fused_add_rms_norm or fn is fused_norm_rotary_write


def cpu_path_of(kernels: Kernels) -> str | None:
    """The instruction path of the compiled CPU ops `kernels` runs (None: no compiled op)."""
    ops = (kernels.gdn_decode_op, kernels.silu_mul, kernels.paged_decode_attention)
    return next((op.path for op in ops if isinstance(op, CpuOp)), None)


def load_fused_cpu_ops(kernels: Kernels, dtype: torch.dtype, device: torch.device | str) -> None:
    """Load now the fused CPU ops `kernels` calls for this dtype and device (bf16 on CPU), each built once
    with the C++ compiler or found in torch's cache, and logged in one line: at start-up, so that no request
    waits minutes for a build while /health already answers (they would load on the first decode step)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return
    from cairn.ops import cpu_attention, cpu_gdn, cpu_norm, cpu_silu

    path = cpu_path_of(kernels)
    if isinstance(kernels.gdn_decode_op, CpuOp):
        cpu_gdn.load_once(path)
    if kernels.add_rms_norm is fused_add_rms_norm or kernels.norm_rotary_write is fused_norm_rotary_write:
        cpu_norm.load_once()
    if isinstance(kernels.silu_mul, CpuOp):
        cpu_silu.load_once(path)
    if isinstance(kernels.paged_decode_attention, CpuOp):
        cpu_attention.load_once()


def select_kernels(device: torch.device | str, fast: bool = False, cpu_path: str = "none") -> Kernels:
    """On a CPU, the reference kernels with the compiled ops of `cpu_path` (cpu_kernels); on CUDA the reference,
    or with `fast` the field's kernels that import (cairn.ops.cuda), the reference standing in for any that do
    not. Chosen once at start-up and logged."""
    if torch.device(device).type == "cpu":
        if fast:
            log.info("fast kernels are CUDA-only: using the pure-PyTorch reference kernels on %s", device)
        return cpu_kernels(cpu_path)
    if not fast or torch.device(device).type != "cuda":
        return REFERENCE
    from cairn.ops import cuda

    found = cuda.kernels()
    if found is None:
        log.info("no fast CUDA kernels installed: using the pure-PyTorch reference kernels")
        return REFERENCE
    name, fast_kernels = found
    chosen = dataclasses.replace(REFERENCE, name=name, **fast_kernels)
    log.info("kernels: %s (untested on GPU; compare with --fast-kernels off)", chosen.name)
    return chosen
