"""Granite-4.0-H (`granitemoehybrid`) against transformers on tiny random checkpoints the tests save.

The config-key tables (every key transformers writes is classified; unimplemented keys and values are
refused naming the key) and the feed-forward block (MoE + shared MLP, dense shared MLP) loaded from the
saved checkpoint's own tensor names.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from cairn.model.config import ConfigError
from cairn.model.granitemoehybrid import GraniteMoE, SharedMLP, ffn_targets, read_config
from tests.granite_checkpoint import FAMILIES, write_checkpoint

TOL = 1e-5

# The keys of a published Granite-4.0-H config.json (Tiny's dimensions).
TINY = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_multiplier": 0.0078125, "bos_token_id": 100257, "embedding_multiplier": 12, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.1, "intermediate_size": 512,
    "layer_types": ["mamba"] * 5 + (["attention"] + ["mamba"] * 9) * 3 + ["attention"] + ["mamba"] * 4,
    "logits_scaling": 6, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64,
    "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_proj_bias": False,
    "max_position_embeddings": 131072, "model_type": "granitemoehybrid", "normalization_function": "rmsnorm",
    "num_attention_heads": 12, "num_experts_per_tok": 6, "num_hidden_layers": 40, "num_key_value_heads": 4,
    "num_local_experts": 64, "output_router_logits": False, "pad_token_id": 100256, "position_embedding_type": "nope",
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000,
    "router_aux_loss_coef": 0.0, "shared_intermediate_size": 1024, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.56.0", "use_cache": True, "vocab_size": 100352,
}


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """{layout: (path, transformers model)} for both Granite layouts."""
    made = {}
    for layout in FAMILIES:
        path = tmp_path_factory.mktemp(layout)
        made[layout] = (path, write_checkpoint(layout, path))
    return made


def config_of(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_published_config_reads_as_granite_tiny():
    cfg = read_config(TINY)
    assert cfg["layer_types"].count("attention") == 4 and len(cfg["layer_types"]) == 40
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "attention"] == [5, 15, 25, 35]
    assert cfg["rope_theta"] is None and cfg["attention_scale"] == 0.0078125 and cfg["head_dim"] == 128
    assert cfg["mamba"] == dict(num_heads=48, head_dim=64, n_groups=1, state_size=128, conv_kernel=4, chunk_size=256,
                                dt_limit=(0.0, float("inf")), conv_bias=True, proj_bias=False)
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["expert_intermediate_size"]) == (64, 6, 512)


@pytest.mark.parametrize("layout", FAMILIES)
def test_every_key_transformers_writes_is_classified(granite, layout):
    path, hf = granite[layout]
    cfg = read_config(config_of(path))
    assert cfg["layer_types"] == ("mamba", "mamba", "attention", "mamba", "attention", "mamba")
    assert cfg["mamba"]["dt_limit"] == (0.0, float("inf"))  # written as {"__float__": "Infinity"}
    assert cfg["embedding_multiplier"] == hf.config.embedding_multiplier
    assert cfg["logits_scaling"] == hf.config.logits_scaling
    assert cfg["num_experts"] == hf.config.num_local_experts
    assert cfg["rope_theta"] == (5000.0 if layout == "granitemoehybrid_dense" else None)


@pytest.mark.parametrize("key, value", [
    ("mup_extra_scale", 2.0), ("layer_types", ["mamba", "moe"] * 20), ("hidden_act", "gelu"),
    ("attention_bias", True), ("normalization_function", "layernorm"), ("position_embedding_type", "alibi"),
    ("quantization_config", {"quant_method": "fp8"}),
])
def test_unimplemented_config_key_is_refused_naming_it(key, value):
    name = "moe" if key == "layer_types" else key
    with pytest.raises(ConfigError, match=name):
        read_config({**TINY, key: value})


def test_rope_other_than_default_is_refused():
    with pytest.raises(ConfigError, match="yarn"):
        read_config({**TINY, "position_embedding_type": "rope", "rope_scaling": {"rope_type": "yarn", "factor": 4}})


def checkpoint_layer(path, layer: int) -> dict[str, torch.Tensor]:
    """The saved tensors of `model.layers.{layer}.`, by the rest of their name."""
    prefix, found = f"model.layers.{layer}.", {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            found.update({k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})  # noqa: SIM118
    return found


@pytest.mark.parametrize("layout", FAMILIES)
def test_feed_forward_block_matches_transformers(granite, layout):
    """The block loaded from the checkpoint's own tensor names equals transformers' moe(h) + shared(h)."""
    path, hf = granite[layout]
    cfg = read_config(config_of(path))
    hidden = cfg["hidden_size"]
    if cfg["num_experts"]:
        ours = GraniteMoE(hidden, cfg["num_experts"], cfg["num_experts_per_tok"], cfg["expert_intermediate_size"],
                          cfg["shared_intermediate_size"])
    else:
        ours = SharedMLP(hidden, cfg["shared_intermediate_size"])
    params = dict(ours.named_parameters())
    placed = 0
    for rest, tensor in checkpoint_layer(path, 3).items():
        for target in ffn_targets(rest) or []:
            params[target.param.removeprefix("mlp.")].data.copy_(tensor)
            placed += tensor.numel()
    assert placed == sum(p.numel() for p in params.values())  # every parameter written, by the saved names
    h = torch.randn(1, 23, hidden, generator=torch.Generator().manual_seed(0))
    layer = hf.model.layers[3]
    with torch.no_grad():
        expected = layer.shared_mlp(h)
        if layer.has_experts:
            expected = expected + layer.block_sparse_moe(h)
        assert (ours(h[0]) - expected[0]).abs().max().item() < TOL
