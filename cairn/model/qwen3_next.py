"""Qwen3-Next (model_type `qwen3_next`).

The same hybrid stack as Qwen3.5 with two checkpoint differences:
- MLPs are sparse MoE except in `mlp_only_layers` and layers off the `decoder_sparse_step` grid;
- Gated DeltaNet projections are fused per key head: `in_proj_qkvz` holds, for each of the k heads,
  [q (Dk) | k (Dk) | v (r * Dv) | z (r * Dv)] with r = v_heads / k_heads, and `in_proj_ba` holds
  [b (r) | a (r)] per k head. They are regrouped at load time into cairn's [q | k | v | z | b | a].
The config is parsed as Qwen3.5's (cairn.model.qwen3_5).
"""

from __future__ import annotations

from typing import Any

import torch

from cairn.model.config import ModelConfig
from cairn.model.hybrid import HybridModel, Target
from cairn.model.qwen3_5 import parse_qwen_config

MODEL_TYPES = ("qwen3_next",)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    return parse_qwen_config(raw, "qwen3_next")


class Qwen3NextForCausalLM(HybridModel):
    def linear_targets(self, rest: str) -> list[Target] | None:
        if rest == "linear_attn.in_proj_qkvz.weight":
            return [Target("mixer.in_proj.weight", (slice(0, self.cfg.conv_dim + self.cfg.linear_value_dim),),
                           self._regroup_qkvz)]
        if rest == "linear_attn.in_proj_ba.weight":
            start = self.cfg.conv_dim + self.cfg.linear_value_dim
            return [Target("mixer.in_proj.weight", (slice(start, start + 2 * self.cfg.linear_num_v_heads),),
                           self._regroup_ba)]
        return super().linear_targets(rest)

    def _regroup_qkvz(self, w: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        r = cfg.linear_num_v_heads // cfg.linear_num_k_heads
        dk, dv = cfg.linear_k_head_dim, cfg.linear_v_head_dim
        grouped = w.reshape(cfg.linear_num_k_heads, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=1)
        return torch.cat([x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)], dim=0)

    def _regroup_ba(self, w: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        r = cfg.linear_num_v_heads // cfg.linear_num_k_heads
        b, a = w.reshape(cfg.linear_num_k_heads, 2 * r, -1).split([r, r], dim=1)
        return torch.cat([b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])], dim=0)


MODEL_CLASS = Qwen3NextForCausalLM
