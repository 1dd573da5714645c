"""Reference kernels for the depthwise causal conv1d of Gated DeltaNet and Mamba2, with its streaming state.

The conv state of a sequence is the last `kernel - 1` inputs it has seen, shape [channels, kernel-1],
so a sequence can be continued at any position from its state alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def check_captures(capture_at: Sequence[tuple[int, torch.Tensor]], seq_len: int) -> None:
    """Every capture point of a prefill segment lies in 1..seq_len (ValueError naming it otherwise)."""
    for count, _ in capture_at:
        if not 1 <= count <= seq_len:
            raise ValueError(f"capture at {count} is outside the segment's {seq_len} tokens")


def causal_conv1d(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, capture_at: Sequence[tuple[int, torch.Tensor]] = (),
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill segment.

    x: [T, C]; state: [C, K-1] (inputs before x); weight: [C, K]; capture_at: (count, out) pairs, count
    in [1, T] (else ValueError): the state after that many tokens is written into `out` ([C, K-1]);
    bias: [C] or None (Mamba2 has one, Gated DeltaNet not).
    Returns (silu(conv(x) + bias) [T, C], new_state [C, K-1]).
    """
    seq_len, kernel = x.shape[0], weight.shape[-1]
    window = torch.cat([state.to(x.dtype).transpose(0, 1), x], dim=0)  # [K-1+T, C], time-major
    # a depthwise conv with a few taps is a few shifted multiply-adds, cheaper than a conv call here
    w = weight.to(x.dtype).transpose(0, 1).contiguous()  # [K, C]
    out = window[0:seq_len] * w[0]
    for k in range(1, kernel):
        out.addcmul_(window[k:k + seq_len], w[k])
    if bias is not None:
        out += bias.to(x.dtype)
    new_state = window[seq_len:].transpose(0, 1)  # the last K-1 inputs
    check_captures(capture_at, seq_len)
    for count, dst in capture_at:  # after `count` tokens, the last K-1 inputs are window[count : count + K-1]
        dst.copy_(window[count : count + kernel - 1].transpose(0, 1))
    return F.silu(out), new_state.contiguous()


def causal_conv1d_update(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch. x: [B, C]; state: [B, C, K-1]; weight: [C, K]; bias: [C] or None.
    Returns (silu(conv + bias) [B, C], new_state [B, C, K-1]); `state` is not modified."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out += bias.to(out.dtype)
    return F.silu(out).to(x.dtype), window[..., 1:]
