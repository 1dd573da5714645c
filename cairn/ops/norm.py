"""RMSNorm and the residual add before it, in pure PyTorch: the reference for cairn/ops/cpu_norm.py.

    rms_norm(x)      = x / sqrt(mean(x^2) + eps) * scale        in fp32, rounded to x's dtype once
    scale            = 1 + weight (zero-centred: the Qwen hybrids) or weight (the Mamba2 hybrids)
    add_rms_norm     = (x + delta, rms_norm(x + delta))         the sum rounded to x's dtype first

cairn.layers.norm's modules compute exactly this; the decoder layers call it through
`Kernels.add_rms_norm` so that a fused op can stand in for it.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return (weight.float() * xf).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)); with delta None, (x, rms_norm(x)). Neither input is modified."""
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps, zero_centred)
