"""Nemotron-H (model_type `nemotron_h`) beyond the per-family contracts of test_model_vs_transformers.py
(which runs prefill, chunked, greedy, batched and state-copy checks on it) and the divergence patterns of
test_cache_patterns.py (parametrised over it): its config keys, layer kinds and state, sharded and bf16
loading, the MoE's latent width, `cairn bench` on a Nemotron-H-shaped checkpoint, and `cairn serve` on it
across a restart. The host and disk tiers, a restart and its own disk namespace: test_tiers.py (parametrised
over it).
"""

from __future__ import annotations

import copy
import json

import openai
import pytest
import torch

from cairn.bench.cli import BenchOptions, bench
from cairn.model.config import ConfigError
from cairn.model.families import config_from_hf
from cairn.model.loader import load_checkpoint
from tests.checkpoints import NEMOTRON_H, write_checkpoint
from tests.harness import prefill
from tests.server_process import start_server
from tests.test_bench import CONFIG, SIZES


def raw_config(checkpoints) -> dict:
    return json.loads((checkpoints["nemotron_h"][0] / "config.json").read_text())


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- config --------------------------------------------------------------------------------------------

def test_pattern_characters_become_single_op_layers(checkpoints):
    raw = raw_config(checkpoints)
    assert "hybrid_override_pattern" not in raw  # transformers 5 writes the list form
    cfg = config_from_hf(raw)
    legacy = {k: v for k, v in raw.items() if k != "layers_block_type"}
    legacy["hybrid_override_pattern"] = NEMOTRON_H["hybrid_override_pattern"]  # M-M*EM-*ME
    assert config_from_hf(legacy) == cfg
    assert cfg.layer_types == ("mamba2", "none", "mamba2", "full_attention", "none", "mamba2", "none",
                               "full_attention", "mamba2", "none")
    assert cfg.ffn_types == ("none", "dense", "none", "none", "moe", "none", "dense", "none", "none", "moe")
    assert (cfg.recurrent_layers, cfg.attention_layers) == ((0, 2, 5, 8), (3, 7))
    assert (cfg.rotary_dim, cfg.attention_gated, cfg.zero_centred_norms) == (0, False, False)


@pytest.mark.parametrize("key,value", [
    ("mlp_hidden_act", "gelu"), ("mamba_hidden_act", "relu"), ("num_nextn_predict_layers", 1),
    ("residual_in_fp32", True), ("n_shared_experts", 2), ("attention_bias", True), ("rope_theta", 10000.0),
    ("hybrid_override_pattern", "M-X*"),
])
def test_unimplemented_config_key_is_refused_by_name(checkpoints, key, value):
    raw = raw_config(checkpoints)
    if key == "hybrid_override_pattern":  # the pattern is read when the list form is absent
        del raw["layers_block_type"]
    raw[key] = value
    with pytest.raises(ConfigError, match="X" if key == "hybrid_override_pattern" else key):
        config_from_hf(raw)


def test_state_slot_holds_each_mamba_layers_conv_and_ssm_state(checkpoints):
    cfg = config_from_hf(raw_config(checkpoints))
    spec = cfg.state_spec(torch.bfloat16)
    m = cfg.mamba
    conv = (m.num_heads * m.head_dim + 2 * m.n_groups * m.state_size) * (m.conv_kernel - 1) * 2  # bf16
    ssm = m.num_heads * m.head_dim * m.state_size * 4  # fp32
    assert [s.layer for s in spec.layers] == [0, 2, 5, 8]
    assert spec.slot_bytes == 4 * (conv + ssm)


# ---- loading -------------------------------------------------------------------------------------------

def test_sharded_checkpoint_loads_the_same_weights_and_bf16_errs_as_transformers_bf16(tmp_path, checkpoints):
    """bf16 rounding moves these logits by up to ~0.2 (and can flip a MoE routing choice) in transformers
    too: cairn's bf16 error against the fp32 logits must stay within 1.5x of transformers' own bf16 error."""
    write_checkpoint("nemotron_h", tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = prompt(90)
    whole, _ = load_checkpoint(checkpoints["nemotron_h"][0], "float32", "cpu", show_progress=False)
    sharded, _ = load_checkpoint(tmp_path, "float32", "cpu", show_progress=False)
    half, _ = load_checkpoint(tmp_path, "bfloat16", "cpu", show_progress=False)
    reference = prefill(whole, ids)
    assert torch.equal(prefill(sharded, ids), reference)
    assert half.embed.weight.dtype == torch.bfloat16
    hf_half = copy.deepcopy(checkpoints["nemotron_h"][1]).to(torch.bfloat16)
    with torch.no_grad():
        hf_error = (hf_half(input_ids=torch.tensor([ids])).logits[0].float() - reference).abs()
    error = (prefill(half, ids) - reference).abs()
    assert error.max().item() < 1.5 * hf_error.max().item()
    assert error.mean().item() < 1.5 * hf_error.mean().item()


def test_moe_with_a_latent_width_matches_transformers(tmp_path):
    import transformers as tf

    torch.manual_seed(3)
    hf = tf.NemotronHForCausalLM(tf.NemotronHConfig(**{**NEMOTRON_H, "hybrid_override_pattern": "ME*E",
                                                       "moe_latent_size": 24})).eval()
    hf.save_pretrained(str(tmp_path))
    model, cfg = load_checkpoint(tmp_path, "float32", "cpu", show_progress=False)
    assert cfg.moe_latent_size == 24
    ids = prompt(70, seed=4)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
    assert (prefill(model, ids) - ref).abs().max().item() < 1e-4


# ---- the checkpoint directory (the tier contracts run on it in test_tiers.py) -----------------------------

@pytest.fixture(scope="module")
def model_dir(checkpoints):
    return str(checkpoints["nemotron_h"][0])


# ---- cairn bench ---------------------------------------------------------------------------------------

def test_bench_runs_its_workloads_on_a_nemotron_h_shaped_checkpoint(tmp_path):
    opts = BenchOptions(size="nemotron-h-tiny", checkpoint_dir=str(tmp_path / "nh"), workloads="edit,compaction",
                        policies="none,cairn", out=str(tmp_path / "out"), plots=False)
    record = bench(opts, CONFIG, command="pytest", sizes=SIZES)
    assert json.loads((tmp_path / "nh" / "config.json").read_text())["model_type"] == "nemotron_h"
    by_policy = {(r.workload, r.policy): r for r in record.results}
    assert set(by_policy) == {(w, p) for w in ("edit", "compaction") for p in ("none", "cairn")}
    for workload in ("edit", "compaction"):
        none, cairn = by_policy[(workload, "none")], by_policy[(workload, "cairn")]
        assert all(r.cached_tokens == 0 for r in none.requests)
        assert sum(r.cached_tokens for r in cairn.requests) > 0
        assert all(r.cached_tokens <= r.oracle_tokens for r in cairn.requests)


# ---- a real server ---------------------------------------------------------------------------------------

def test_cairn_serve_loads_the_checkpoint_and_resumes_from_disk_after_a_restart(tmp_path, model_dir):
    """`cairn serve --model DIR` on the unchanged checkpoint: a chat, a restart on the same --disk-cache, and the
    follow-up resumes from disk with the cold answer."""
    flags = ("--model", model_dir, "--snapshot-interval", "64", "--page-size", "8")
    messages = [{"role": "system", "content": "You are terse. " + "Keep every answer short. " * 6},
                {"role": "user", "content": "List three colours of the sky at dusk, please."}]

    def chat(*extra: str, messages: list[dict]) -> dict:
        server = start_server(*flags, *extra)
        try:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
            name = client.models.list().data[0].id
            reply = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                   extra_body={"ignore_eos": True})
        finally:
            assert server.stop() == 0
        return reply

    first = chat("--disk-cache", str(tmp_path), messages=messages)
    follow_up = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "And at dawn?"}]
    warm = chat("--disk-cache", str(tmp_path), messages=follow_up)
    usage = warm.usage.model_dump()
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0 and usage["cairn"]["tier"] == "disk"
    cold = chat("--no-prefix-cache", messages=follow_up)
    assert warm.choices[0].message.content == cold.choices[0].message.content
