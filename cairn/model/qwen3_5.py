"""Qwen3.5 dense (model_type `qwen3_5` with nested `text_config`, or `qwen3_5_text`).

Every layer has a dense SwiGLU MLP; three Gated DeltaNet layers to one gated attention layer by
default (`layer_types`). The checkpoint's Gated DeltaNet projections are separate (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a) and are fused into one in_proj at load time. Weights sit under
`model.language_model.` in the multimodal layout and under `model.` in the text-only one.
"""

from __future__ import annotations

from cairn.model.hybrid import HybridModel


class Qwen3_5ForCausalLM(HybridModel):
    """The HybridModel as is: dense MLPs, split Gated DeltaNet projections."""
