"""RMS norms: the Qwen hybrids' zero-centred one, the plain one of the Mamba2 hybrids, and a gated one."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + weight), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


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


class PlainRMSNorm(nn.Module):
    """RMSNorm with a plain scale: x / rms(x) * weight, the product in fp32 (Nemotron-H, Granite, Falcon-H1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)
