"""Reference kernels for the depthwise causal conv1d of Gated DeltaNet, with its streaming state.

The conv state of a sequence is the last `kernel - 1` inputs it has seen, shape [channels, kernel-1],
so a sequence can be continued at any position from its state alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill segment.

    x: [T, C]; state: [C, K-1] (inputs before x); weight: [C, K].
    Returns (silu(conv(x)) [T, C], new_state [C, K-1]).
    """
    seq_len = x.shape[0]
    window = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=-1)  # [C, K-1+T]
    out = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    new_state = window[:, -state.shape[-1]:] if state.shape[-1] else window[:, :0]
    return F.silu(out[0, :, -seq_len:]).transpose(0, 1).to(x.dtype), new_state


def causal_conv1d_update(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch. x: [B, C]; state: [B, C, K-1]; weight: [C, K]."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    return F.silu(out).to(x.dtype), window[..., 1:]
