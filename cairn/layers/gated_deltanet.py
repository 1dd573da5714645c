"""Gated DeltaNet: the linear-attention token mixer of the Qwen hybrid family.

    in_proj(x) -> [ q k v | z | b | a ]          one fused projection (conv_dim + value_dim + 2 * v_heads)
    q k v -> causal depthwise conv1d (kernel K, with a [conv_dim, K-1] streaming state) -> silu
    beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)          (per value head, log decay)
    o = gated_delta_rule(q, k, v, g, beta; recurrent state [v_heads, k_dim, v_dim] in fp32)
    out_proj(GatedRMSNorm(o, z))

Both states live in the request's working slot of the StatePool: decode sequences run as one batch
through the recurrent step, prefill segments one at a time through the chunked kernel.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from cairn.layers.norm import GatedRMSNorm
from cairn.memory.state_pool import StatePool
from cairn.model.batch import ForwardBatch
from cairn.model.config import ModelConfig
from cairn.ops import Kernels

# Longest piece of a prefill segment given to the prefill kernels at once. The chunked delta rule and
# the conv are linear in length, but their fp32 intermediates for a 2048-token chunk (tens of MB per
# layer) outgrow the CPU caches: 1024-token pieces ran 1.3x faster per layer at the 0.8B shape.
MAX_PIECE = 1024


def _pieces(start: int, length: int,
            captures: list[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """How a segment of `length` tokens from absolute position `start` is run: (lo, hi, [(count within the
    piece, capture slot)]), lo and hi offsets in the segment.

    Pieces of at most MAX_PIECE tokens, cut at absolute multiples of MAX_PIECE (so a segment that starts
    at a multiple of 64 keeps the chunked kernel's 64-token chunks on absolute multiples of 64), each
    continuing the state of the one before; a capture at offset c (the state after c tokens of the
    segment) goes to the piece that computes it, and the kernels return it without splitting the piece.
    """
    first = (start // MAX_PIECE + 1) * MAX_PIECE - start
    bounds = [0, *range(first, length, MAX_PIECE), length]
    return [(lo, hi, [(c - lo, dst) for c, dst in captures if lo < c <= hi]) for lo, hi in pairwise(bounds)]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, pool_index: int):
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_num_k_heads, cfg.linear_num_v_heads
        self.k_dim, self.v_dim = cfg.linear_k_head_dim, cfg.linear_v_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.linear_key_dim, cfg.linear_value_dim, cfg.conv_dim
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, cfg.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.pool_index = pool_index  # this layer's index in the StatePool's layer dimension

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states: StatePool, kernels: Kernels) -> torch.Tensor:
        tokens = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.v_heads, self.v_heads], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv_states, rec_states = states.conv[self.pool_index], states.recurrent[self.pool_index]
        out = torch.empty(tokens, self.v_heads, self.v_dim, dtype=x.dtype, device=x.device)

        nd = batch.num_decode
        if nd:
            slots = batch.decode_slots()  # a slice (a view into the pool) when the slots are consecutive
            mixed_d, conv_states[slots] = kernels.causal_conv1d_update(mixed[:nd], conv_states[slots], self.conv_weight)
            q, k, v = self._split_heads(mixed_d)
            state = rec_states[slots]
            out[:nd], state = kernels.recurrent_gated_delta_rule(q, k, v, g[:nd], beta[:nd], state)
            if not isinstance(slots, slice):  # a gathered copy: write it back
                rec_states[slots] = state
        for i, row, new, context in batch.prefill_segments():
            slot = int(batch.state_slots[i])
            start = context - new  # absolute position of the segment's first token
            for lo, hi, caps in _pieces(start, new, [(p - start, dst) for p, dst in batch.captures_of(i)]):
                rows, pool = slice(row + lo, row + hi), batch.capture_pool
                mixed_p, conv_states[slot] = kernels.causal_conv1d(
                    mixed[rows], conv_states[slot], self.conv_weight,
                    [(c, pool.conv[self.pool_index, dst]) for c, dst in caps])
                q, k, v = self._split_heads(mixed_p)
                out[rows], rec_states[slot] = kernels.chunk_gated_delta_rule(
                    q, k, v, g[rows], beta[rows], rec_states[slot],
                    [(c, pool.recurrent[self.pool_index, dst]) for c, dst in caps])

        out = self.norm(out, z.reshape(tokens, self.v_heads, self.v_dim))
        return self.out_proj(out.reshape(tokens, self.value_dim))

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = mixed.shape[0]
        return (q.reshape(n, self.k_heads, self.k_dim), k.reshape(n, self.k_heads, self.k_dim),
                v.reshape(n, self.v_heads, self.v_dim))
