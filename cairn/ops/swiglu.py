"""SwiGLU's activation product in pure PyTorch: the reference for cairn/ops/cpu_small_ops.py's silu_mul.

    silu_mul(gate, up) = silu(gate) * up        silu rounded to the inputs' dtype, then the product
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
