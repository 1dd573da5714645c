"""Tiny random Granite-4.0-H (`granitemoehybrid`) checkpoints, written by transformers' save_pretrained.

Two layouts, between them every option cairn implements for the family:

    granitemoehybrid        MoE (4 experts, top 2) + shared MLP, Mamba2 with 2 groups, no position
                            embedding ("nope"), tied embeddings, layer_types as published ("mamba" /
                            "attention", which transformers 5 rewrites on save and this puts back)
    granitemoehybrid_dense  dense (shared MLP only, as Granite-4.0-H-Micro), rope, untied lm_head,
                            Mamba2 with one group and biased projections, saved in shards

The muP multipliers are set off 1 (as in the real checkpoints), and the weights transformers initialises
to ones (norm scales, D, dt_bias) are drawn at random, so that a model ignoring or misplacing one fails.
Each directory gets cairn's byte-level tokenizer (cairn.bench.checkpoint.write_tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cairn.bench.checkpoint import write_tokenizer

LAYERS = ["mamba", "mamba", "attention", "mamba", "attention", "mamba"]
BASE = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=len(LAYERS), num_attention_heads=4, num_key_value_heads=2,
    mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
    initializer_range=0.05, rms_norm_eps=1e-5, embedding_multiplier=6.0, residual_multiplier=0.5,
    attention_multiplier=1 / 16, logits_scaling=2.0, layer_types=LAYERS,
)
LAYOUTS = {
    "granitemoehybrid": dict(
        intermediate_size=32, shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        mamba_n_groups=2, position_embedding_type="nope", tie_word_embeddings=True),
    "granitemoehybrid_dense": dict(
        intermediate_size=96, shared_intermediate_size=96, num_local_experts=0, mamba_n_groups=1,
        mamba_proj_bias=True, position_embedding_type="rope", rope_parameters={"rope_type": "default",
        "rope_theta": 5000.0}, tie_word_embeddings=False),
}
FAMILIES = tuple(LAYOUTS)


def hf_model(layout: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**BASE, **LAYOUTS[layout]))
    with torch.no_grad():  # what transformers leaves at ones gets random values: a misplaced one then shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".D", "dt_bias")):
                p.uniform_(0.5, 1.5)
    return model


def write_checkpoint(layout: str, path: Path, seed: int = 0, **save_kwargs):
    """Save a random tiny model of `layout` (fp32) plus tokenizer to `path`; returns the HF model."""
    model = hf_model(layout, seed).eval()
    if layout == "granitemoehybrid_dense":
        save_kwargs.setdefault("max_shard_size", "100KB")
    model.save_pretrained(str(path), **save_kwargs)
    if layout == "granitemoehybrid":  # the published configs' layer names
        config = json.loads((path / "config.json").read_text())
        config["layer_types"] = LAYERS
        (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return model
