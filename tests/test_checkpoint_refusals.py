"""What each family's parser and weight router refuse, and the defaults it fills in, on real checkpoints.

Every case starts from a tiny random checkpoint transformers wrote (tests/checkpoints.py), changes one thing
in its config.json or adds one tensor to its safetensors, and checks the loader's answer: a ConfigError or
WeightError naming what does not fit, or the value cairn takes where the key is absent. The checkpoints are
copied before a tensor is added (the session's copies are shared with other tests).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import torch

from cairn.model.config import ConfigError
from cairn.model.families import config_from_hf
from cairn.model.hybrid import WeightError
from cairn.model.loader import load_checkpoint, read_config


def raw_config(checkpoints, family: str) -> dict:
    return json.loads((checkpoints[family][0] / "config.json").read_text())


def text_of(raw: dict) -> dict:
    """The dict holding the text model's keys (the multimodal wrapper's text_config, else the whole)."""
    return raw.get("text_config", raw)


def _set_rope(key, value):
    def change(raw):
        text_of(raw)["rope_parameters"] = {**text_of(raw)["rope_parameters"], key: value}
    return change


def _put(**values):
    def change(raw):
        text_of(raw).update(values)
    return change


def _drop(*keys):
    def change(raw):
        for key in keys:
            text_of(raw).pop(key, None)
    return change


def _pattern_instead_of_list(layers: int):
    def change(raw):
        raw.pop("layers_block_type")
        raw["hybrid_override_pattern"], raw["num_hidden_layers"] = "M-M*EM-*ME", layers
    return change


REFUSED = [  # (family, change to config.json, what the error names)
    ("qwen3_5_text", _put(model_type="llama"), "model_type 'llama' is not supported"),
    ("qwen3_5_text", _put(num_key_value_heads=3), "multiple of num_key_value_heads"),
    ("qwen3_5_text", _set_rope("partial_rotary_factor", 2.0), "oversized rotary dim"),
    ("qwen3_5_text", _set_rope("rope_type", "linear"), "rope_type='linear'"),
    ("qwen3_5_text", _put(linear_num_value_heads=3), "multiple of linear_num_key_heads"),
    ("qwen3_5_text", _put(layer_types=["linear_attention", "full_attention"]), "2 entries for 6 layers"),
    ("qwen3_5_text", _put(layer_types=["sliding_attention"] * 6), "'sliding_attention' is not implemented"),
    ("qwen3_5", lambda raw: raw.update(audio_config={}), "key 'audio_config'"),
    ("qwen3_5_moe", _put(norm_topk_prob=False), "norm_topk_prob=False"),
    ("nemotron_h", _put(n_routed_experts=7), "multiple of n_group"),
    ("nemotron_h", _put(n_groups=3), "multiple of its groups"),
    ("nemotron_h", _put(layers_block_type=[]), "needs hybrid_override_pattern"),
    ("nemotron_h", _pattern_instead_of_list(9), "10 layers, num_hidden_layers 9"),
    ("falcon_h1", _put(mamba_d_head=7), "mamba_d_head=7"),
    ("falcon_h1", _put(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers must be a list of 5"),
    ("granitemoehybrid", _put(num_experts_per_tok=5), "num_experts_per_tok=5 for 4 experts"),
    ("granitemoehybrid", _put(mamba_d_head=7), "mamba_n_heads \\* mamba_d_head"),
    ("granitemoehybrid", _put(layer_types=["mamba"] * 5), "5 entries for 6 layers"),
    ("granitemoehybrid", _put(time_step_limit=[0.0, 1.0, 2.0]), "time_step_limit must be a list of 2 numbers"),
    ("granitemoehybrid_dense", _set_rope("factor", 2.0), "rope_parameters.factor"),
]


@pytest.mark.parametrize("family,change,names", REFUSED, ids=[f"{f}-{n}" for f, _, n in REFUSED])
def test_config_that_does_not_fit_is_refused_naming_why(checkpoints, family, change, names):
    raw = raw_config(checkpoints, family)
    config_from_hf(raw)  # the checkpoint as written parses
    change(raw)
    with pytest.raises(ConfigError, match=names):
        config_from_hf(raw)


def test_what_no_parser_builds_is_still_refused_by_validate(checkpoints):
    """The guards under every parser: one FFN kind per layer, only the mixers cairn implements, and no biases
    on gated attention (each family's key table refuses these first)."""
    cfg = config_from_hf(raw_config(checkpoints, "qwen3_5_text"))
    with pytest.raises(ConfigError, match="5 FFN kinds for 6 layers"):
        dataclasses.replace(cfg, ffn_types=cfg.ffn_types[:5]).validate()
    with pytest.raises(ConfigError, match="'sliding_attention' is not implemented"):
        dataclasses.replace(cfg, layer_types=("sliding_attention",) * 6).validate()
    with pytest.raises(ConfigError, match="gated attention with biases"):
        dataclasses.replace(cfg, attention_bias=True).validate()


def test_qwen_layer_kinds_follow_full_attention_interval_without_layer_types(checkpoints):
    raw = raw_config(checkpoints, "qwen3_5_text")
    listed = config_from_hf(raw).layer_types
    del raw["layer_types"]
    raw["full_attention_interval"] = 3
    assert config_from_hf(raw).layer_types == listed == ("linear_attention", "linear_attention", "full_attention") * 2


def test_model_without_recurrent_layers_loads_with_a_warning(checkpoints, caplog):
    raw = raw_config(checkpoints, "qwen3_5_text")
    raw["layer_types"] = ["full_attention"] * 6
    with caplog.at_level(logging.WARNING, logger="cairn.model.config"):
        cfg = config_from_hf(raw)
    assert cfg.recurrent_layers == () and "no recurrent layers" in caplog.text


def test_multi_token_prediction_layers_are_logged_as_skipped(checkpoints, caplog):
    raw = raw_config(checkpoints, "qwen3_5_text")
    raw["mtp_num_hidden_layers"] = 1
    with caplog.at_level(logging.INFO, logger="cairn.model.qwen3_5"):
        config_from_hf(raw)
    assert "1 multi-token-prediction layer(s): skipped" in caplog.text


def test_nemotron_older_key_names_and_absent_keys_take_the_documented_defaults(checkpoints):
    raw = raw_config(checkpoints, "nemotron_h")
    raw["mamba_n_groups"] = raw.pop("n_groups")  # the older alias is read
    raw.pop("time_step_limit", None)  # neither name: no limit
    assert config_from_hf(raw).mamba.dt_limit == (0.0, float("inf"))
    raw["mamba_dt_limit"] = [0.01, {"__float__": "Infinity"}]  # the older alias, infinity as transformers writes it
    mamba = config_from_hf(raw).mamba
    assert mamba.n_groups == 2 and mamba.dt_limit == (0.01, float("inf"))


def test_nemotron_step_size_is_limited_by_time_step_limit_not_time_step_min(checkpoints):
    """time_step_min initialises dt_bias; the clamp is time_step_limit (NVIDIA's implementation, and transformers
    from 5.25). Before, cairn clamped at time_step_min as older transformers did: outputs of real checkpoints
    moved (a step under 0.001 was raised to it)."""
    raw = raw_config(checkpoints, "nemotron_h")
    raw["time_step_min"], raw["time_step_limit"] = 0.001, [0.0, float("inf")]
    assert config_from_hf(raw).mamba.dt_limit == (0.0, float("inf"))
    raw["time_step_limit"] = [0.0]
    with pytest.raises(ValueError, match="time_step_limit must be a list of 2 numbers"):
        config_from_hf(raw)


def test_checkpoint_directory_without_config_or_weights_is_refused(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_config(tmp_path)
    shutil.copy(checkpoints["qwen3_5_text"][0] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        load_checkpoint(tmp_path, "float32", "cpu", show_progress=False)


UNPLACED = [  # (family, an extra tensor no parameter of the model takes)
    ("qwen3_5_text", "model.layers.6.mlp.down_proj.weight"),  # a layer past the last
    ("qwen3_5_text", "model.layers.0.mlp.fused_proj.weight"),  # an unknown MLP tensor
    ("qwen3_5_text", "model.layers.0.self_attn.k_norm.weight"),  # attention's, on a Gated DeltaNet layer
    ("qwen3_5_text", "model.layers.2.linear_attn.A_log"),  # Gated DeltaNet's, on an attention layer
    ("qwen3_5_moe", "model.language_model.layers.0.mlp.experts.gate_proj"),  # an unknown expert tensor
    ("nemotron_h", "backbone.layers.10.norm.weight"),  # a layer past the last
    ("nemotron_h", "backbone.layers.0.adapter.weight"),  # neither a norm nor the mixer
    ("nemotron_h", "backbone.layers.1.mixer.experts.0.gate_proj.weight"),  # an MLP layer has no gate
    ("falcon_h1", "model.layers.0.adapter.weight"),  # no attention, Mamba2, norm or MLP tensor
    ("falcon_h1_tied", "model.layers.0.mamba.out_proj.bias"),  # projectors_bias=False: no bias to fill
    ("granitemoehybrid_dense", "model.layers.0.block_sparse_moe.router.layer.weight"),  # a dense model
]


@pytest.mark.parametrize("family,name", UNPLACED, ids=[f"{f}-{n}" for f, n in UNPLACED])
def test_tensor_the_model_has_no_place_for_is_refused_naming_it(checkpoints, tmp_path, family, name):
    from safetensors.torch import load_file, save_file

    path = tmp_path / family
    shutil.copytree(checkpoints[family][0], path)
    first = sorted(path.glob("*.safetensors"))[0]
    tensors = load_file(str(first))
    tensors[name] = torch.zeros(4)
    save_file(tensors, str(first), metadata={"format": "pt"})
    with pytest.raises(WeightError, match=f"tensor '{name}' has no place"):
        load_checkpoint(path, "float32", "cpu", show_progress=False)


def test_tensor_of_the_wrong_shape_is_refused_naming_both_shapes(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model"
    shutil.copytree(checkpoints["qwen3_5_text"][0], path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros(63)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"model.norm.weight: shape \(63,\) does not fit norm.weight"):
        load_checkpoint(path, "float32", "cpu", show_progress=False)
