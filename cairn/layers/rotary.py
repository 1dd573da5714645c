"""Partial rotary position embedding: the first `rotary_dim` dims of each head are rotated, in halves."""

from __future__ import annotations

import torch
from torch import nn

from cairn.ops import attention


class PartialRotary(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        # A plain attribute, not a buffer: the model may be built on the meta device and filled from a
        # checkpoint, and these frequencies are derived from the config, never loaded.
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self.inv_freq = 1.0 / (theta ** exponent)
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, rotary_dim] for absolute positions [T], computed in fp32."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    apply = staticmethod(attention.rotate)  # x [T, heads, head_dim], cos, sin [T, rotary_dim] -> x rotated
