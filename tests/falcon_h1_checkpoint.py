"""Tiny random Falcon-H1 checkpoints for the tests, written with transformers' own save_pretrained.

Two variants, covering the family's switches: `falcon_h1` (gated grouped RMSNorm in the mixer, norm after
the gate, every optional bias, untied head) and `falcon_h1_tied` (the shipped 0.5B's choices: no mixer
norm, no biases, tied embeddings). Every multiplier takes a value other than 1, no two alike, so a
multiplier applied in the wrong place, twice or not at all changes the logits; the one-dimensional
parameters that transformers initialises to constants (norm weights, dt_bias, A_log, D, biases) are
randomised, so that two tensors swapped by name change them too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cairn.bench.checkpoint import write_tokenizer

MULTIPLIERS = dict(
    embedding_multiplier=2.5, lm_head_multiplier=0.4, key_multiplier=0.6, attention_in_multiplier=0.8,
    attention_out_multiplier=1.3, ssm_in_multiplier=1.25, ssm_out_multiplier=0.7,
    ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], mlp_multipliers=[0.9, 0.6],
)
# head_dim is not hidden_size / num_attention_heads and mamba_d_ssm is not mamba_expand * hidden_size,
# as in the real checkpoints; chunk 16 makes a 150-token prompt span several SSD chunks.
FALCON_H1 = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
    mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, initializer_range=0.05,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **MULTIPLIERS,
)
VARIANTS = {
    "falcon_h1": dict(mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_proj_bias=True,
                      attention_bias=True,
                      projectors_bias=True, mamba_conv_bias=True, tie_word_embeddings=False),
    "falcon_h1_tied": dict(mamba_rms_norm=False, mamba_proj_bias=False, projectors_bias=False,
                           mamba_conv_bias=True, tie_word_embeddings=True),
}


def hf_falcon_h1(variant: str = "falcon_h1", seed: int = 0, **overrides):
    """A transformers FalconH1ForCausalLM with random weights (fp32, eval mode)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.FalconH1ForCausalLM(tf.FalconH1Config(**{**FALCON_H1, **VARIANTS[variant], **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 1:
                continue
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p) - 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # dt_bias, D and biases
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def write_falcon_h1(path: Path, variant: str = "falcon_h1", seed: int = 0, **save_kwargs):
    """Save a random tiny Falcon-H1 plus a byte-level tokenizer to `path`; returns the HF model."""
    model = hf_falcon_h1(variant, seed)
    model.save_pretrained(str(path), **save_kwargs)
    write_tokenizer(path)
    return model
