"""The checkpoint loader: layouts, shards, tied embeddings, dtypes, skipped towers, refused config keys."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from cairn.model.config import ConfigError
from cairn.model.families import config_from_hf
from cairn.model.hybrid import WeightError
from cairn.model.loader import load_checkpoint
from tests.checkpoints import hf_model, write_tokenizer
from tests.harness import prefill

IDS = list(range(3, 60))


def _logits_match(path, hf, dtype="float32", tol=1e-4):
    model, _ = load_checkpoint(path, dtype, "cpu", show_progress=False)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([IDS])).logits[0].float()
    diff = (prefill(model, IDS).float() - ref).abs().max().item()
    assert diff < tol, diff
    return model


def test_sharded_checkpoint_with_index_loads(tmp_path):
    hf = hf_model("qwen3_5_moe").eval()
    hf.save_pretrained(str(tmp_path), max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    _logits_match(tmp_path, hf)


def test_missing_shard_is_an_error_naming_it(tmp_path):
    hf_model("qwen3_5_text").save_pretrained(str(tmp_path), max_shard_size="50KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_checkpoint(tmp_path, "float32", "cpu", show_progress=False)


def test_tied_embeddings_share_the_lm_head(tmp_path):
    import transformers as tf

    from tests.checkpoints import TEXT

    torch.manual_seed(0)
    hf = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**{**TEXT, "tie_word_embeddings": True})).eval()
    hf.save_pretrained(str(tmp_path))
    model = _logits_match(tmp_path, hf)
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtype_option(checkpoints, dtype):
    path, hf = checkpoints["qwen3_5"]
    model, _ = load_checkpoint(path, dtype, "cpu", show_progress=False)
    assert model.embed.weight.dtype == getattr(torch, dtype)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([IDS])).logits[0]
    ours = prefill(model, IDS).float()
    assert (ours - ref).abs().max().item() < 0.1  # half precision against the fp32 reference
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


def test_vision_and_mtp_tensors_are_skipped_and_logged(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    hf = hf_model("qwen3_5").eval()
    hf.save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mtp.layers.0.mlp.down_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="cairn"):
        _logits_match(tmp_path, hf)
    assert any("model.visual" in r.message and "skipped" in r.message for r in caplog.records)


def test_unexpected_tensor_is_an_error_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("qwen3_5_text").save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.linear_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightError, match="mystery"):
        load_checkpoint(tmp_path, "float32", "cpu", show_progress=False)


def test_missing_tensor_is_an_error_naming_the_parameter(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("qwen3_5_text").save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightError, match="layers.2.mixer.k_norm.weight"):
        load_checkpoint(tmp_path, "float32", "cpu", show_progress=False)


@pytest.mark.parametrize("key,value", [
    ("attn_output_gate", False), ("hidden_act", "gelu"), ("output_gate_type", "swish"), ("mamba_ssm_dtype", "bfloat16"),
    ("quantization_config", {"quant_method": "fp8"}), ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
])
def test_unimplemented_config_key_is_refused_by_name(checkpoints, tmp_path, key, value):
    raw = json.loads((checkpoints["qwen3_5_text"][0] / "config.json").read_text())
    raw[key] = value
    with pytest.raises(ConfigError, match=key.split("_")[0]):
        config_from_hf(raw)


def test_multimodal_and_flat_layouts_parse_to_the_same_architecture(checkpoints):
    wrapped = json.loads((checkpoints["qwen3_5"][0] / "config.json").read_text())
    flat = json.loads((checkpoints["qwen3_5_text"][0] / "config.json").read_text())
    a, b = config_from_hf(wrapped), config_from_hf(flat)
    assert a.weight_prefix == "model.language_model." and b.weight_prefix == "model."
    assert (a.layer_types, a.hidden_size, a.rotary_dim) == (b.layer_types, b.hidden_size, b.rotary_dim)


def test_qwen3_next_moe_and_dense_layers_follow_mlp_only_layers(checkpoints):
    cfg = config_from_hf(json.loads((checkpoints["qwen3_next"][0] / "config.json").read_text()))
    assert cfg.moe_layers == (True, False, True, True, False, True)


def test_tokenizer_and_chat_template_load_from_the_checkpoint(tmp_path):
    from cairn.request.tokenizer import HFTokenizer

    write_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    ids, starts = tok.encode_chat(msgs)
    text = tok.decode(ids)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == (tok.special_tokens["<|im_end|>"],)
    # message starts: the user message, then the generation prompt
    assert len(starts) == 2 and all(tok.decode(ids[:s]).endswith("<|im_end|>\n") for s in starts)
    assert tok.decode(ids[starts[0]:starts[1]]) == "<|im_start|>user\nhéllo<|im_end|>\n"


def test_building_a_model_leaves_torch_dynamo_unimported_and_torch_nn_init_as_it_was():
    """Modules are built on the meta device with torch.nn.init's functions as no-ops: the first normal_ on a meta
    tensor imported torch._dynamo, about 2 s of every server's and CLI call's start-up. The functions are put
    back after the build, and an engine built so serves."""
    code = ("import sys, torch\n"
            "before = {n: getattr(torch.nn.init, n) for n in dir(torch.nn.init)}\n"
            "from cairn.engine.llm import LLM\n"
            "from cairn.request.sampling_params import SamplingParams\n"
            "llm = LLM(kv_cache_gib=0.05, state_cache_gib=0.05)\n"
            "out = llm.generate([[10, 11, 12]], SamplingParams(max_tokens=2, temperature=0.0))[0]\n"
            "assert all(getattr(torch.nn.init, n) is f for n, f in before.items())\n"
            "print(len(out.token_ids), 'torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "False"]
