"""Full attention over the paged KV pool: Qwen's gated attention, and plain attention.

GatedAttention, per head: q and k get a zero-centred RMSNorm over head_dim, then partial rotary; keys and values of
the new tokens are written to the pool (the three in one `Kernels.norm_rotary_write` call: one C++ op in bf16 on
CPU), then each query attends over its sequence's whole context.
The output is scaled by sigmoid(gate), where the gate is the second half of each head's q_proj row
block ([q_h | gate_h] per head), and projected back by o_proj. Grouped-query: num_heads is a multiple
of num_kv_heads.

Attention (Nemotron-H, Granite-4.0-H, Falcon-H1): q, k, v projections (optionally biased), rotary on
q and k when the model has one (None: no positional encoding, as Granite-4.0-H's NoPE), the same paged
attention with the spec's softmax scale, then o_proj. No q/k norm, no output gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from cairn.forward_batch import ForwardBatch
from cairn.layers.norm import RMSNorm
from cairn.layers.rotary import PartialRotary
from cairn.memory.kv_pool import KVPool
from cairn.ops import Kernels
from cairn.ops.attention import write_kv


@dataclass(frozen=True)
class AttentionSpec:
    """The shape of one gated attention mixer (built by the model's config)."""

    hidden_size: int  # model width, the mixer's input and output size
    num_heads: int  # query heads, a multiple of num_kv_heads
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # of the q / k RMSNorms
    bias: bool = False  # q/k/v/o projections have biases (plain Attention only)
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (plain Attention only)


class GatedAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, pool_index: int, rotary: PartialRotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, 2 * self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, spec.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, spec.norm_eps)
        self.rotary = rotary
        self.pool_index = pool_index  # this layer's index in the KV pool's layer dimension
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv: KVPool, kernels: Kernels) -> torch.Tensor:
        return self.attend(x, batch, cos_sin, kv, kernels, self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    def attend(self, x: torch.Tensor, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: KVPool,
               kernels: Kernels, q_proj: Callable, k_proj: Callable, v_proj: Callable,
               o_proj: Callable) -> torch.Tensor:
        """forward with its four projections given (the modules, or a decode plan's direct kernel calls)."""
        tokens = x.shape[0]
        q, gate = q_proj(x).view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        k_pool, v_pool = kv.k[self.pool_index], kv.v[self.pool_index]
        q_norm, k_norm = self.q_norm, self.k_norm
        q = kernels.norm_rotary_write(q, k, v, q_norm.weight, k_norm.weight, q_norm.eps, q_norm.zero_centred,
                                      *cos_sin, k_pool, v_pool, batch.slot_mapping)
        nd = batch.num_decode
        if nd == tokens:  # decode rows alone: the attention's output is the layer's, gated where it lies
            out = kernels.paged_decode_attention(q, k_pool, v_pool, batch.page_tables, batch.decode_context_lens(),
                                                 self.scale)
            return o_proj(out.mul_(torch.sigmoid(gate)).reshape(tokens, -1))
        out = torch.empty_like(q)
        if nd:
            out[:nd] = kernels.paged_decode_attention(
                q[:nd], k_pool, v_pool, batch.page_tables[:nd], batch.decode_context_lens(), self.scale)
        for i, row, new, context in batch.prefill_segments():
            out[row:row + new] = kernels.paged_prefill_attention(
                q[row:row + new], k_pool, v_pool, batch.page_tables[i], context, self.scale)
        return o_proj(out.mul_(torch.sigmoid(gate)).view(tokens, -1))


class Attention(nn.Module):
    """Plain grouped-query attention: o_proj(attend(rotary(q_proj x), rotary(k_proj x), v_proj x))."""

    def __init__(self, spec: AttentionSpec, pool_index: int, rotary: PartialRotary | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, self.num_heads * self.head_dim, bias=spec.bias)
        self.k_proj = nn.Linear(spec.hidden_size, self.num_kv_heads * self.head_dim, bias=spec.bias)
        self.v_proj = nn.Linear(spec.hidden_size, self.num_kv_heads * self.head_dim, bias=spec.bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=spec.bias)
        self.rotary = rotary
        self.pool_index = pool_index  # this layer's index in the KV pool's layer dimension
        self.scale = spec.scale if spec.scale is not None else self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                kv: KVPool, kernels: Kernels) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary.apply(q, *cos_sin), self.rotary.apply(k, *cos_sin)
        out = paged_attention(q, k, v, batch, kv, self.pool_index, kernels, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, kv: KVPool,
                    pool_index: int, kernels: Kernels, scale: float) -> torch.Tensor:
    """Write the step's k, v [T, kv_heads, head_dim] into layer `pool_index` of the pool, then attend each
    query [T, heads, head_dim] over its sequence's whole context: decode rows as one batch, each prefill
    segment on its own. Returns [T, heads, head_dim]."""
    k_pool, v_pool = kv.k[pool_index], kv.v[pool_index]
    write_kv(k, v, k_pool, v_pool, batch.slot_mapping)
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        out[:nd] = kernels.paged_decode_attention(
            q[:nd], k_pool, v_pool, batch.page_tables[:nd], batch.decode_context_lens(), scale)
    for i, row, new, context in batch.prefill_segments():
        out[row:row + new] = kernels.paged_prefill_attention(
            q[row:row + new], k_pool, v_pool, batch.page_tables[i], context, scale)
    return out
