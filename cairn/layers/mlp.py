"""Feed-forward blocks: the SwiGLU MLP and the sparse MoE block with a gated shared expert (Qwen hybrids);
the squared-ReLU MLP and the sigmoid-routed, grouped MoE block with a shared expert (Nemotron-H / Nemotron 3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cairn.ops import REFERENCE, Kernels


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused in one [2 * inner, hidden] weight; the activation is
    `Kernels.silu_mul` (one op on CPU in bf16, the same bits)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    @property
    def takes_kernels(self) -> bool:
        """The decoder layer passes its Kernels to forward (a subclass with its own forward gets x alone)."""
        return type(self).forward is SwiGLU.forward

    def forward(self, x: torch.Tensor, kernels: Kernels = REFERENCE) -> torch.Tensor:
        return self.down(kernels.silu_mul(self.gate_up(x)))


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


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x)) ** 2): a non-gated MLP."""

    def __init__(self, hidden: int, inner: int, bias: bool = False):
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=bias)
        self.down = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


class SigmoidMoE(nn.Module):
    """Top-k routed squared-ReLU experts plus an always-on shared expert (DeepSeek-V3-style routing).

    Scores are sigmoid(router(x)) in fp32. Experts are chosen on score + `score_bias`: the experts fall
    into `n_group` equal groups, each group is ranked by the sum of its two best choice scores, only the
    best `topk_group` groups stay eligible, and the top-k of those are taken. Their weights are their
    scores (not score + bias), renormalised to sum to 1 when `norm_topk_prob`, times
    `routed_scaling_factor`. With `latent`, the experts run in a smaller width between two projections.
    Experts are stacked: up [E, inner, width], down [E, width, inner]; sums are accumulated in fp32.
    """

    READS_LINEAR_WEIGHTS = ("router",)  # route() reads router.weight itself: a weight layout keeps it as loaded

    def __init__(self, hidden: int, num_experts: int, top_k: int, inner: int, shared_inner: int, *,
                 norm_topk_prob: bool, routed_scaling_factor: float, n_group: int, topk_group: int,
                 latent: int | None = None, bias: bool = False):
        super().__init__()
        width = latent or hidden
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.score_bias = nn.Parameter(torch.zeros(num_experts))
        self.up = nn.Parameter(torch.empty(num_experts, inner, width))
        self.down = nn.Parameter(torch.empty(num_experts, width, inner))
        self.shared = ReluSquaredMLP(hidden, shared_inner, bias)
        self.latent_in = nn.Linear(hidden, latent, bias=bias) if latent else None
        self.latent_out = nn.Linear(latent, hidden, bias=bias) if latent else None
        self.top_k, self.norm_topk_prob, self.scaling = top_k, norm_topk_prob, routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k]) for x [T, hidden]."""
        scores = F.linear(x.float(), self.router.weight.float()).sigmoid()
        choice = scores + self.score_bias.float()
        groups = choice.view(x.shape[0], self.n_group, -1)
        group_rank = groups.topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_rank).scatter_(1, group_rank.topk(self.topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~kept.bool().repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        h = self.latent_in(x) if self.latent_in is not None else x
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.up.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order[start:start + n]
            tokens = rows // self.top_k
            start += n
            y = F.linear(F.relu(F.linear(h[tokens], self.up[e])).square(), self.down[e])
            out.index_add_(0, tokens, y.float() * weights.flatten()[rows].unsqueeze(-1))
        routed = out.to(x.dtype)
        if self.latent_out is not None:
            routed = self.latent_out(routed)
        return routed + self.shared(x)
