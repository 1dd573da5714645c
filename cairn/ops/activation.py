"""The SwiGLU activation in pure PyTorch: the reference for cairn/ops/cpu_silu.py.

    silu_mul(gate_up) = silu(gate) * up,  [gate | up] = gate_up's halves along the last dimension

In bf16 the silu is rounded to bf16, then the product (exact in fp32) once more: two ATen calls and
their intermediate tensor. cairn.layers.mlp.SwiGLU calls it through `Kernels.silu_mul` so that a fused
op can stand in for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
