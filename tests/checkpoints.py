"""Tiny random Hugging Face checkpoints for the tests, written with transformers' own save_pretrained.

Every family and on-disk layout cairn loads: qwen3_5 (multimodal wrapper, weights under
model.language_model.*), qwen3_5_text (flat), qwen3_5_moe (wrapper, per-expert tensors) and qwen3_next
(interleaved Gated DeltaNet projections, MoE and dense layers mixed); nemotron_h (Mamba2, attention,
squared-ReLU MLP and grouped sigmoid-routed MoE single-op layers); falcon_h1 and falcon_h1_tied
(tests/falcon_h1_checkpoint.py); granitemoehybrid (MoE) and granitemoehybrid_dense (sharded, rope)
(tests/granite_checkpoint.py). Each directory also gets a
byte-level tokenizer.json and a ChatML chat template (cairn.bench.checkpoint.write_tokenizer, which
the benchmarks' named sizes use too), so cairn's loader sees a complete checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cairn.bench.checkpoint import write_tokenizer
from tests import granite_checkpoint
from tests.falcon_h1_checkpoint import VARIANTS as FALCON_H1_VARIANTS
from tests.falcon_h1_checkpoint import hf_falcon_h1

TEXT = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.05, rms_norm_eps=1e-6,
    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
NEMOTRON_H = dict(
    vocab_size=320, hidden_size=64, hybrid_override_pattern="M-M*EM-*ME", num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
    ssm_state_size=16, conv_kernel=4, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
    routed_scaling_factor=1.5, initializer_range=0.05, layer_norm_epsilon=1e-5, eos_token_id=2,
)
FAMILIES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_next", "nemotron_h", *FALCON_H1_VARIANTS,
            *granite_checkpoint.FAMILIES)


def hf_model(family: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen3_5":
        return tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=TEXT, vision_config=VISION))
    if family == "qwen3_5_text":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**TEXT))
    if family == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeConfig(text_config={**TEXT, **MOE}, vision_config=VISION)
        return tf.Qwen3_5MoeForConditionalGeneration(cfg)
    if family == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**TEXT, **MOE, decoder_sparse_step=1, mlp_only_layers=[1, 4]))
    if family == "nemotron_h":
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(**NEMOTRON_H))
        _randomise_nemotron_h(model)
        return model
    if family in FALCON_H1_VARIANTS:
        return hf_falcon_h1(family, seed=seed)  # tests/falcon_h1_checkpoint.py: every multiplier set
    if family in granite_checkpoint.FAMILIES:
        return granite_checkpoint.hf_model(family, seed)
    raise ValueError(family)


def _randomise_nemotron_h(model) -> None:
    """Weights transformers leaves at a constant (norm scales, D, dt_bias, the router and its score bias) get
    random values, so a wrong mapping of them cannot pass unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias")):
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)


def write_checkpoint(family: str, path: Path, seed: int = 0, **save_kwargs):
    """Save a random tiny model of `family` (fp32) plus tokenizer to `path`; returns the HF model."""
    if family in granite_checkpoint.FAMILIES:  # its own layout: shards, the published layer names
        return granite_checkpoint.write_checkpoint(family, path, seed, **save_kwargs)
    model = hf_model(family, seed).eval()
    model.save_pretrained(str(path), **save_kwargs)
    write_tokenizer(path)
    return model
