"""Gated DeltaNet: the linear-attention token mixer of the Qwen hybrid family.

    in_proj(x) -> [ q k v | z | b | a ]          one fused projection (conv_dim + value_dim + 2 * v_heads)
    q k v -> causal depthwise conv1d (kernel K, with a [conv_dim, K-1] streaming state) -> silu
    beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)          (per value head, log decay)
    o = gated_delta_rule(q, k, v, g, beta; recurrent state [v_heads, k_dim, v_dim] in fp32)
    out_proj(GatedRMSNorm(o, z))

Both states live in the request's working slot of the StatePool (`state_entries` declares them):
decode sequences run as one batch through the recurrent step, prefill segments piece by piece through
the chunked kernel (cairn.layers.recurrent). In bf16 on CPU the decode rows take one fused op instead
(conv update to gated norm, cairn/ops/cpu_gdn.py) when `kernels.gdn_decode_op` offers it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cairn.forward_batch import ForwardBatch
from cairn.layers.norm import GatedRMSNorm
from cairn.layers.recurrent import RecurrentMixer
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import StateTensor
from cairn.ops import Kernels


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """The shape of one Gated DeltaNet mixer (built by the model's config)."""

    hidden_size: int  # model width, the mixer's input and output size
    num_k_heads: int  # query / key heads
    num_v_heads: int  # value heads, a multiple of num_k_heads
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # K, taps of the causal conv
    norm_eps: float

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv: q, k and v concatenated."""
        return 2 * self.key_dim + self.value_dim

    def state_entries(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        """The conv's last K-1 inputs in the model dtype, the delta rule's state in fp32."""
        return (StateTensor("conv", (self.conv_dim, self.conv_kernel - 1), dtype),
                StateTensor("recurrent", (self.num_v_heads, self.k_head_dim, self.v_head_dim), torch.float32))


class GatedDeltaNet(RecurrentMixer):
    def __init__(self, spec: GatedDeltaNetSpec, layer: int):
        super().__init__()
        self.spec, self.layer = spec, layer
        self.k_heads, self.v_heads = spec.num_k_heads, spec.num_v_heads
        self.k_dim, self.v_dim = spec.k_head_dim, spec.v_head_dim
        self.key_dim, self.value_dim, self.conv_dim = spec.key_dim, spec.value_dim, spec.conv_dim
        self.in_proj = nn.Linear(spec.hidden_size, self.conv_dim + self.value_dim + 2 * self.v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, spec.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, spec.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, spec.hidden_size, bias=False)

    def state_entries(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        return self.spec.state_entries(dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states: StatePool, kernels: Kernels) -> torch.Tensor:
        projected = self.in_proj(x)
        nd = batch.num_decode
        fused = None
        if nd:
            params, eps = self.fused_params()
            fused = kernels.gdn_decode_op(projected, *params)
        if fused is None:
            return self.out_proj(self._reference_rows(projected, 0, batch, states, kernels))
        if nd == x.shape[0]:  # a pure decode batch: one op between the projections
            return self.out_proj(self.fused_decode(fused, projected, batch, states, params, eps))
        decoded = self.fused_decode(fused, projected[:nd], batch, states, params, eps)
        return self.out_proj(torch.cat([decoded, self._reference_rows(projected, nd, batch, states, kernels)]))

    def _reference_rows(self, projected: torch.Tensor, first: int, batch: ForwardBatch, states: StatePool,
                        kernels: Kernels) -> torch.Tensor:
        """Rows [first, T) of in_proj's output through the reference kernels: [T - first, value_dim], out_proj's
        input. first is 0 (every row) or num_decode (the fused op took the decode rows; their gating is not
        computed again here)."""
        tokens, nd = projected.shape[0] - first, batch.num_decode if first == 0 else 0
        mixed, z, b, a = projected[first:].split([self.conv_dim, self.value_dim, self.v_heads, self.v_heads], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        own = states.of_layer(self.layer)
        conv_states, rec_states = own["conv"], own["recurrent"]
        out = torch.empty(tokens, self.v_heads, self.v_dim, dtype=projected.dtype, device=projected.device)
        if nd:
            slots = batch.decode_slots()  # a slice (a view into the pool) when the slots are consecutive
            mixed_d, conv_states[slots] = kernels.causal_conv1d_update(mixed[:nd], conv_states[slots], self.conv_weight)
            q, k, v = self._split_heads(mixed_d)
            state = rec_states[slots]
            out[:nd], state = kernels.recurrent_gated_delta_rule(q, k, v, g[:nd], beta[:nd], state)
            if not isinstance(slots, slice):  # a gathered copy: write it back
                rec_states[slots] = state
        for absolute, slot, caps in self.prefill_pieces(batch):
            rows = slice(absolute.start - first, absolute.stop - first)
            mixed_p, conv_states[slot] = kernels.causal_conv1d(
                mixed[rows], conv_states[slot], self.conv_weight, [(c, dst["conv"]) for c, dst in caps])
            q, k, v = self._split_heads(mixed_p)
            out[rows], rec_states[slot] = kernels.chunk_gated_delta_rule(
                q, k, v, g[rows], beta[rows], rec_states[slot], [(c, dst["recurrent"]) for c, dst in caps])
        return self.norm(out, z.reshape(tokens, self.v_heads, self.v_dim)).reshape(tokens, self.value_dim)

    def fused_params(self) -> tuple[tuple[torch.Tensor, ...], float]:
        """The fused op's parameters (conv weight, A_log, dt_bias, norm weight) and the norm's eps, each looked up
        once (nn.Module.__getattr__: ~1 us a lookup, 18 layers a step)."""
        norm = self.norm
        return (self.conv_weight, self.A_log, self.dt_bias, norm.weight), norm.eps

    def fused_decode(self, fused, projected: torch.Tensor, batch: ForwardBatch, states: StatePool,
                     params: tuple[torch.Tensor, ...], eps: float) -> torch.Tensor:
        """The decode rows through the fused op (cairn/ops/cpu_gdn.py): [nd, value_dim], out_proj's input.
        params: conv weight, A_log, dt_bias, norm weight; eps: the norm's. The op updates both states where they
        lie; gathered copies (scattered slots) are written back."""
        mixed, z, b, a = projected.split([self.conv_dim, self.value_dim, self.v_heads, self.v_heads], dim=-1)
        own = states.of_layer(self.layer)
        slots = batch.decode_slots()
        conv, rec = own["conv"][slots], own["recurrent"][slots]
        out = fused(mixed, z, b, a, conv, rec, *params, self.k_heads, eps)
        if not isinstance(slots, slice):
            own["conv"][slots], own["recurrent"][slots] = conv, rec
        return out

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = mixed.shape[0]
        return (q.reshape(n, self.k_heads, self.k_dim), k.reshape(n, self.k_heads, self.k_dim),
                v.reshape(n, self.v_heads, self.v_dim))
