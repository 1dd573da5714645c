"""Feed-forward blocks: the SwiGLU MLP and the sparse MoE block with a gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused in one [2 * inner, hidden] weight."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Top-k routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

    Router probabilities are a softmax over all experts in fp32; the top-k are renormalised to sum to 1
    when `norm_topk_prob`. Experts are stacked: gate_up [E, 2 * inner, hidden], down [E, hidden, inner].
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, inner: int, shared_inner: int, norm_topk_prob: bool):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self.shared = SwiGLU(hidden, shared_inner)
        self.shared_gate = nn.Linear(hidden, 1, bias=False)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        token_of = order // self.top_k
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order[start:start + n]
            tokens = token_of[start:start + n]
            start += n
            gate, up = F.linear(x[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e])
            out.index_add_(0, tokens, y * weights.flatten()[rows].unsqueeze(-1))
        return out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
