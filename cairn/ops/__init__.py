"""Kernels behind one interface, chosen once at start-up.

`select_kernels(device)` returns a `Kernels` whose fields are the pure-PyTorch references in this
package, or a fast implementation with the same signature where one is installed for the device.
Fast CUDA kernels are imported lazily here and only on CUDA; nothing on a CPU machine imports
triton or flash-linear-attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cairn.ops import attention, conv, gdn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """The kernel set a model runs with; each field documents its contract in its reference module."""

    name: str
    chunk_gated_delta_rule: Callable = gdn.chunk_gated_delta_rule
    recurrent_gated_delta_rule: Callable = gdn.recurrent_gated_delta_rule
    causal_conv1d: Callable = conv.causal_conv1d
    causal_conv1d_update: Callable = conv.causal_conv1d_update
    paged_prefill_attention: Callable = attention.paged_prefill_attention
    paged_decode_attention: Callable = attention.paged_decode_attention


REFERENCE = Kernels(name="reference")


def select_kernels(device: torch.device | str) -> Kernels:
    """The fastest kernel set available for `device`; the pure-PyTorch reference when none is."""
    if torch.device(device).type != "cuda":
        return REFERENCE
    try:
        from cairn.ops import cuda  # noqa: F401  (optional fast kernels; absent in this release)
    except ImportError:
        log.info("no fast CUDA kernels installed: using the pure-PyTorch reference kernels")
        return REFERENCE
    return cuda.KERNELS  # pragma: no cover
