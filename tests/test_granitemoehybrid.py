"""Granite-4.0-H (`granitemoehybrid`) against transformers on tiny random checkpoints the tests save.

The config-key tables (every key transformers writes is classified; unimplemented keys and values are
refused naming the key), the feed-forward block (MoE + shared MLP, dense shared MLP) loaded from the
saved checkpoint's own tensor names (the whole-model transformers contracts, prefill to state copy, run
on both layouts in test_model_vs_transformers.py); sharded, tied / untied and bf16 loading; and a real
`cairn serve` on it. The prefix cache through the real engine runs in the shared tests, parametrised over
Granite: every divergence pattern, fp32 and bit for bit in bf16 / fp16 (test_cache_patterns.py), each tier
and a restart (test_tiers.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from cairn.model.config import ConfigError, Mamba2Shape
from cairn.model.families import config_from_hf
from cairn.model.granitemoehybrid import GraniteMoE, SharedMLP, ffn_targets
from cairn.model.loader import load_checkpoint
from tests.granite_checkpoint import FAMILIES
from tests.harness import prefill

TOL = 1e-5  # one block, fp32

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
def granite(checkpoints):
    """{layout: (path, transformers model)} for both Granite layouts: the session's (tests/checkpoints.py)."""
    return {layout: checkpoints[layout] for layout in FAMILIES}


def config_of(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_published_config_reads_as_granite_tiny():
    cfg = config_from_hf(TINY)
    assert cfg.family == "granitemoehybrid" and cfg.num_layers == 40
    assert cfg.attention_layers == (5, 15, 25, 35) and len(cfg.mamba_layers) == 36
    assert cfg.ffn_types == ("moe",) * 40 and not cfg.zero_centred_norms and not cfg.attention_gated
    assert cfg.rotary_dim == 0 and cfg.attention_scale == 0.0078125 and cfg.head_dim == 128
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_multiplier) == (12.0, 0.22, 1 / 6)
    assert cfg.mamba == Mamba2Shape(num_heads=48, head_dim=64, n_groups=1, state_size=128, conv_kernel=4,
                                    chunk_size=256, norm_eps=1e-5, conv_bias=True)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (64, 6, 512)
    assert cfg.shared_expert_intermediate_size == 1024 and cfg.tie_word_embeddings


@pytest.mark.parametrize("layout", FAMILIES)
def test_every_key_transformers_writes_is_classified(granite, layout):
    path, hf = granite[layout]
    cfg = config_from_hf(config_of(path))
    assert cfg.layer_types == ("mamba2", "mamba2", "full_attention", "mamba2", "full_attention", "mamba2")
    assert cfg.mamba.dt_limit == (0.0, float("inf"))  # written as {"__float__": "Infinity"}
    assert cfg.embedding_multiplier == hf.config.embedding_multiplier
    assert cfg.logits_multiplier == 1 / hf.config.logits_scaling
    assert cfg.num_experts == hf.config.num_local_experts
    assert cfg.rotary_dim == (16 if layout == "granitemoehybrid_dense" else 0)


@pytest.mark.parametrize("key, value", [
    ("mup_extra_scale", 2.0), ("layer_types", ["mamba", "moe"] * 20), ("hidden_act", "gelu"),
    ("attention_bias", True), ("normalization_function", "layernorm"), ("position_embedding_type", "alibi"),
    ("quantization_config", {"quant_method": "fp8"}),
])
def test_unimplemented_config_key_is_refused_naming_it(key, value):
    name = "moe" if key == "layer_types" else key
    with pytest.raises(ConfigError, match=name):
        config_from_hf({**TINY, key: value})


def test_rope_other_than_default_is_refused():
    with pytest.raises(ConfigError, match="yarn"):
        config_from_hf({**TINY, "position_embedding_type": "rope", "rope_scaling": {"rope_type": "yarn", "factor": 4}})


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
    cfg = config_from_hf(config_of(path))
    hidden = cfg.hidden_size
    if cfg.num_experts:
        ours = GraniteMoE(hidden, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                          cfg.shared_expert_intermediate_size)
    else:
        ours = SharedMLP(hidden, cfg.intermediate_size)
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


# ---- the whole model, loaded by cairn's loader ---------------------------------------------------------


def prompt(n: int, seed: int = 1, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def load(path, dtype: str = "float32"):
    return load_checkpoint(path, dtype, "cpu", show_progress=False)[0]


def test_sharded_untied_and_tied_checkpoints_load(granite):
    dense_path, _ = granite["granitemoehybrid_dense"]
    assert (dense_path / "model.safetensors.index.json").is_file()
    assert len(list(dense_path.glob("*.safetensors"))) > 2
    dense, tied = load(dense_path), load(granite["granitemoehybrid"][0])
    assert dense.lm_head.weight.data_ptr() != dense.embed.weight.data_ptr()
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()


@pytest.mark.parametrize("layout", FAMILIES)
def test_bf16_loading_follows_transformers(granite, layout):
    path, hf = granite[layout]
    model = load(path, "bfloat16")
    assert model.embed.weight.dtype == torch.bfloat16
    ids = prompt(60, seed=6)
    ours, ref = prefill(model, ids).float(), hf_logits(hf, ids)
    assert (ours - ref).abs().max().item() < 0.1  # bf16 against the fp32 reference
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


def test_unimplemented_key_in_a_checkpoint_is_refused_at_load(granite, tmp_path):
    import shutil

    path = tmp_path / "granite"
    shutil.copytree(granite["granitemoehybrid"][0], path)
    raw = config_of(path)
    raw["mamba_rms_norm_group"] = 4
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="mamba_rms_norm_group"):
        load(path)


# ---- a real server ------------------------------------------------------------------------------------

def test_cairn_serve_loads_a_granite_checkpoint_and_resumes_its_conversation(granite):
    """A real `cairn serve` subprocess on the checkpoint directory: a chat, then its next turn resumes."""
    from tests.server_process import openai_client, start_server

    path = granite["granitemoehybrid"][0]
    server = start_server("--model", str(path), "--dtype", "float32", "--log-level", "WARNING")
    try:
        client = openai_client(server)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Hello, Granite"}]
        first = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And again"}]
        second = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
    finally:
        server.stop()
    assert first.usage.completion_tokens == second.usage.completion_tokens == 6
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_a_checkpoint_without_recurrent_layers_generates_as_transformers_without_a_prefix_cache(tmp_path, monkeypatch):
    """A family checkpoint whose layers are all attention (no Mamba2 layer: nothing to snapshot) loads with
    no prefix cache (the engine's NullCache) and decodes greedily as transformers does; a repeated prompt
    is computed again, reporting nothing cached."""
    from cairn import LLM, SamplingParams
    from tests import granite_checkpoint

    monkeypatch.setitem(granite_checkpoint.BASE, "layer_types", ["attention"] * 3)
    monkeypatch.setitem(granite_checkpoint.BASE, "num_hidden_layers", 3)
    hf = granite_checkpoint.write_checkpoint("granitemoehybrid_dense", tmp_path)
    ids = [71, 68, 75, 75, 78, 220, 83, 71, 68, 81, 68]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
    llm = LLM(str(tmp_path), kv_cache_gib=0.01, state_cache_gib=0.01)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first, again = llm.generate([ids], greedy)[0], llm.generate([ids], greedy)[0]
    assert first.token_ids == expected and again.token_ids == expected
    assert again.cache.cached_tokens == 0
