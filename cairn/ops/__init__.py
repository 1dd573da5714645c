"""Kernels behind one interface, chosen once at start-up.

`select_kernels(device, fast)` returns a `Kernels` whose fields are the pure-PyTorch references in
this package, or, when asked for (`--fast-kernels`, off by default) on CUDA, a fast implementation
with the same signature where one is installed (cairn/ops/cuda.py: flash-linear-attention,
causal-conv1d, FlashInfer). Fast kernels are imported lazily and only then; nothing on a CPU machine
imports triton, flash-linear-attention, causal-conv1d or flashinfer.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cairn.ops import attention, conv, gdn, mamba2

log = logging.getLogger(__name__)


@functools.cache
def _cpu_op(name: str):
    """Module cairn.ops.<name>, imported on first use: importing the package does not import the ops' modules,
    so that `python -m cairn.ops.cpu_gdn --build` runs it once, as __main__ only. Cached: an import statement
    in a function costs about a microsecond a call, and these run ~100 times a decode step."""
    return importlib.import_module(f"cairn.ops.{name}")


def fused_gdn_decode_op(*tensors: torch.Tensor):
    """cpu_gdn.op_for, imported on first use (`_cpu_op`)."""
    return _cpu_op("cpu_gdn").op_for(*tensors)


def fused_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_norm.add_rms_norm (bf16 on CPU: one C++ op, the reference's bits; else the reference), imported
    on first use like fused_gdn_decode_op."""
    return _cpu_op("cpu_norm").add_rms_norm(x, delta, weight, eps, zero_centred)


def fused_norm_rotary_write(*args):
    """cpu_norm.norm_rotary_write (bf16 on CPU: one C++ op, the reference's bits; else the reference),
    imported on first use like fused_gdn_decode_op."""
    return _cpu_op("cpu_norm").norm_rotary_write(*args)


def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """cpu_silu.silu_mul (bf16 on CPU: one C++ op, ATen's bits; else the reference), imported on first use like
    fused_gdn_decode_op."""
    return _cpu_op("cpu_silu").silu_mul(gate_up)


def fused_paged_decode_attention(*args) -> torch.Tensor:
    """cpu_attention.paged_decode_attention (bf16 on CPU: one C++ op reading the pages in place; else the
    reference), imported on first use like fused_gdn_decode_op."""
    return _cpu_op("cpu_attention").paged_decode_attention(*args)


@dataclass(frozen=True)
class Kernels:
    """The kernel set a model runs with; each field documents its contract in its reference module."""

    name: str
    chunk_gated_delta_rule: Callable = gdn.chunk_gated_delta_rule
    recurrent_gated_delta_rule: Callable = gdn.recurrent_gated_delta_rule
    causal_conv1d: Callable = conv.causal_conv1d
    causal_conv1d_update: Callable = conv.causal_conv1d_update
    paged_prefill_attention: Callable = attention.paged_prefill_attention
    # one query token per sequence over its paged context (cairn/ops/attention.py: paged_decode_attention); bf16 on
    # CPU through one C++ op that reads keys and values in place (cpu_attention.py: not the reference's bits)
    paged_decode_attention: Callable = fused_paged_decode_attention
    mamba_conv1d: Callable = mamba2.mamba_conv1d
    mamba_conv1d_update: Callable = mamba2.mamba_conv1d_update
    ssd_chunk_scan: Callable = mamba2.ssd_chunk_scan
    ssd_recurrent_step: Callable = mamba2.ssd_recurrent_step
    # x -> the fused Gated DeltaNet decode op for that batch, or None for the kernels above (bf16 on CPU:
    # cairn's C++ op, cairn/ops/cpu_gdn.py; cpu_gdn.reference_op_for keeps the reference everywhere)
    gdn_decode_op: Callable = fused_gdn_decode_op
    # (x, delta | None, weight, eps, zero_centred) -> (x + delta, rms_norm(x + delta)): the residual add and the
    # norm after it (cairn/ops/norm.py); bf16 on CPU through one C++ op with the same bits (cpu_norm.py)
    add_rms_norm: Callable = fused_add_rms_norm
    # the gated attention's q / k norms, rotary and KV write (cairn/ops/attention.py: norm_rotary_write); bf16 on
    # CPU through one C++ op with the same bits (cpu_norm_rotary.py)
    norm_rotary_write: Callable = fused_norm_rotary_write
    # gate_up [..., 2 * inner] -> silu(gate) * up, SwiGLU's activation (cairn/ops/activation.py); bf16 on CPU through
    # one C++ op with ATen's bits (cpu_silu.py)
    silu_mul: Callable = fused_silu_mul


REFERENCE = Kernels(name="reference")


def load_fused_cpu_ops(kernels: Kernels, dtype: torch.dtype, device: torch.device | str) -> None:
    """Load now the fused CPU ops `kernels` calls for this dtype and device (bf16 on CPU), each built once
    with the C++ compiler or found in torch's cache, and logged in one line: at start-up, so that no request
    waits minutes for a build while /health already answers (they would load on the first decode step)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return
    from cairn.ops import cpu_attention, cpu_gdn, cpu_norm, cpu_silu

    if kernels.gdn_decode_op is fused_gdn_decode_op:
        cpu_gdn.load_once()
    if kernels.add_rms_norm is fused_add_rms_norm or kernels.norm_rotary_write is fused_norm_rotary_write:
        cpu_norm.load_once()
    if kernels.silu_mul is fused_silu_mul:
        cpu_silu.load_once()
    if kernels.paged_decode_attention is fused_paged_decode_attention:
        cpu_attention.load_once()


def select_kernels(device: torch.device | str, fast: bool = False) -> Kernels:
    """The reference kernels, or with `fast` on CUDA the field's kernels that import (cairn.ops.cuda),
    the reference standing in for any that do not. Chosen once at start-up and logged."""
    if not fast or torch.device(device).type != "cuda":
        if fast:
            log.info("fast kernels are CUDA-only: using the pure-PyTorch reference kernels on %s", device)
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
