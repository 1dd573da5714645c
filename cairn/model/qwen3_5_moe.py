"""Qwen3.5-MoE (model_type `qwen3_5_moe`, multimodal wrapper with `text_config`).

As Qwen3.5 dense, but every layer's MLP is a sparse MoE block: softmax router over `num_experts`,
top `num_experts_per_tok` renormalised, plus a shared expert scaled by a sigmoid gate. Experts come
per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj`) or already stacked
(`mlp.experts.gate_up_proj` [E, 2 * inner, hidden], `mlp.experts.down_proj` [E, hidden, inner]).
The config is parsed as Qwen3.5's (cairn.model.qwen3_5), with every FFN a MoE.
"""

from __future__ import annotations

from typing import Any

from cairn.model.config import ModelConfig
from cairn.model.hybrid import HybridModel
from cairn.model.qwen3_5 import parse_qwen_config

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class Qwen3_5MoeForCausalLM(HybridModel):
    """The HybridModel with every `ffn_types` entry "moe" (set by the parser for this family)."""


MODEL_CLASS = Qwen3_5MoeForCausalLM


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    return parse_qwen_config(raw, "qwen3_5_moe")
