"""RMS norms: the Qwen hybrids' zero-centred one, the plain one of the Mamba2 hybrids, and a gated one.

The first two compute cairn/ops/norm.py's reference and are never called on their own: `add_and_norm` runs
the residual add before the norm and the norm in one call of `Kernels.add_rms_norm` (a fused op on CPU in
bf16, the same bits), and attention's q / k norms hand their weight, eps and `zero_centred` to
`Kernels.norm_rotary_write`. So they hold the weights and the rule, and have no `forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from cairn.ops import Kernels


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + weight), computed in fp32."""

    zero_centred = True

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)) in one kernel call; delta None: (x, norm(x)). Inputs are not modified."""
        return kernels.add_rms_norm(x, delta, self.weight, self.eps, self.zero_centred)


class GatedRMSNorm(nn.Module):
    """RMSNorm then a SiLU gate: (x / rms(x) * weight) * silu(gate). The weight is not zero-centred."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * nn.functional.silu(gate.float())).to(dtype)


class PlainRMSNorm(RMSNorm):
    """RMSNorm with a plain scale: x / rms(x) * weight, the product in fp32 (Nemotron-H, Granite, Falcon-H1)."""

    zero_centred = False

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.ones_(self.weight)
