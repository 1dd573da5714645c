"""Qwen3.5-MoE (model_type `qwen3_5_moe`, multimodal wrapper with `text_config`).

As Qwen3.5 dense, but every layer's MLP is a sparse MoE block: softmax router over `num_experts`,
top `num_experts_per_tok` renormalised, plus a shared expert scaled by a sigmoid gate. Experts come
per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj`) or already stacked
(`mlp.experts.gate_up_proj` [E, 2 * inner, hidden], `mlp.experts.down_proj` [E, hidden, inner]).
"""

from __future__ import annotations

from cairn.model.hybrid import HybridModel


class Qwen3_5MoeForCausalLM(HybridModel):
    """The HybridModel with `moe_layers` all True (set by ModelConfig for this family)."""
