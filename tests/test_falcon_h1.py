"""Falcon-H1 (parallel attention + Mamba2 in every layer, with its multipliers) on tiny random checkpoints
(the transformers contracts, prefill to state copy, run on both variants in test_model_vs_transformers.py):
sharded and half-precision checkpoints; config keys cairn does not implement are refused by name; the
real `cairn serve` loads the checkpoint directory. Through the real engine, every cache divergence
pattern (fp32, and bit for bit in bf16 / fp16: test_cache_patterns.py), each tier and a restart
(test_tiers.py) run in the shared tests, parametrised over Falcon-H1.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from cairn.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from cairn.model.config import ConfigError
from cairn.model.families import config_from_hf
from cairn.model.loader import load_checkpoint
from tests.falcon_h1_checkpoint import VARIANTS
from tests.harness import prefill
from tests.server_process import openai_client, start_server

TOL = 1e-4


@pytest.fixture(scope="module")
def falcon(checkpoints):
    """{variant: (path, transformers model)}: the session's checkpoints of both variants (tests/checkpoints.py,
    on which test_model_vs_transformers.py runs the prefill, chunked, greedy, batched and state-copy contracts)."""
    return {variant: checkpoints[variant] for variant in VARIANTS}


def prompt(n: int, seed: int = 1, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def test_sharded_checkpoint_loads_the_same_logits(falcon, tmp_path):
    path, hf = falcon["falcon_h1"]
    hf.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = prompt(60, seed=6)
    sharded, _ = load_checkpoint(tmp_path, "float32", "cpu", show_progress=False)
    whole, _ = load_checkpoint(path, "float32", "cpu", show_progress=False)
    assert torch.equal(prefill(sharded, ids), prefill(whole, ids))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_loads_in_its_own_dtype(falcon, variant, dtype, tmp_path):
    """Saved in half precision, loaded with --dtype auto: the model computes in that dtype, and its logits
    are no further from transformers' in that dtype than transformers' own half-precision logits are from
    its fp32 ones (twice that, for rounding in other places)."""
    fp32 = falcon[variant][1]
    half = copy.deepcopy(fp32).to(dtype)
    half.save_pretrained(str(tmp_path))
    ids = prompt(50, seed=7)
    expected = hf_logits(half, ids)
    rounding = (expected - hf_logits(fp32, ids)).abs().max().item()
    model, _ = load_checkpoint(tmp_path, "auto", "cpu", show_progress=False)
    assert model.embed.weight.dtype == dtype
    got = prefill(model, ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rounding > 0 and (got - expected).abs().max().item() < 2 * rounding


def saved_config(falcon, variant: str = "falcon_h1") -> dict:
    return json.loads((falcon[variant][0] / "config.json").read_text())


@pytest.mark.parametrize(("key", "value"), [
    ("mlp_bias", True), ("mamba_use_mlp", False), ("attn_layer_indices", [0, 2]),
    ("hidden_act", "gelu"), ("quantization_config", {"quant_method": "fp8"}), ("sliding_window", 512),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
])
def test_unimplemented_config_key_is_refused_naming_it(falcon, key, value):
    raw = {**saved_config(falcon), key: value}
    with pytest.raises(ConfigError, match=key.split("_parameters")[0]):
        config_from_hf(raw)


def test_every_key_of_a_saved_config_is_known(falcon):
    """Each key transformers writes for this family is read, pinned or of no effect: nothing unknown."""
    for variant in VARIANTS:
        assert config_from_hf(saved_config(falcon, variant)).family == "falcon_h1"


def test_shipped_config_keys_are_known(falcon):
    """The keys of the released Falcon-H1 configs that transformers does not write itself (their original
    training code's) parse: initialisation-only values, and switches at the one value implemented."""
    raw = {**saved_config(falcon), "mamba_use_mlp": True, "attn_layer_indices": None, "mlp_expansion_factor": 8,
           "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4, "rope_scaling": None,
           "time_step_limit": [0.0, float("inf")]}
    raw.pop("rope_parameters")
    cfg = config_from_hf({**raw, "rope_theta": 1e11})
    assert cfg.family == "falcon_h1" and cfg.rope_theta == 1e11


@pytest.mark.parametrize("widths", [
    {"mamba_d_ssm": 96, "mamba_n_heads": 12, "mamba_d_head": "auto"},  # head dim derived: 8
    {"mamba_d_ssm": None, "mamba_expand": 2, "mamba_n_heads": 16},  # inner = expand * hidden = 128
    {"mamba_n_heads": 128},  # mamba_d_ssm absent: transformers' default 1024, head dim 8
])
def test_mamba_widths_are_those_transformers_derives(falcon, widths):
    import transformers as tf

    raw = {k: v for k, v in saved_config(falcon).items() if k not in ("mamba_d_ssm", "mamba_d_head")}
    raw.update(widths)
    theirs = tf.FalconH1Config(**{k: v for k, v in raw.items() if k != "time_step_limit"})
    inner = theirs.mamba_d_ssm if theirs.mamba_d_ssm is not None else theirs.mamba_expand * theirs.hidden_size
    ours = config_from_hf(raw).mamba
    assert (ours.num_heads, ours.head_dim) == (theirs.mamba_n_heads, theirs.mamba_d_head)
    assert ours.num_heads * ours.head_dim == inner


def test_mixer_multipliers_survive_a_meta_device_build():
    """The loader builds models on the meta device and materialises them with `to_empty`: the Mamba2 mixer's
    ssm_multipliers scale (derived from the config, never loaded) must come out of that intact."""
    spec = Mamba2Spec(32, 4, 8, 2, 16, 4, 16, zxbcdt_multipliers=(0.5, 1.5, 0.8, 1.2, 0.9))
    torch.manual_seed(0)
    eager = Mamba2Mixer(spec)
    with torch.device("meta"):
        lazy = Mamba2Mixer(spec)
    lazy = lazy.to_empty(device="cpu")
    lazy.load_state_dict(eager.state_dict())
    hidden = torch.randn(9, 32)
    with torch.no_grad():
        assert torch.equal(torch.cat(lazy._project(hidden), -1), torch.cat(eager._project(hidden), -1))


# ---- a real server ------------------------------------------------------------------------------------

def test_cairn_serve_loads_the_checkpoint_and_a_follow_up_resumes(falcon):
    """The real server (preflight, loader, engine thread, HTTP) on the unchanged checkpoint directory."""
    server = start_server("--model", str(falcon["falcon_h1"][0]), "--dtype", "float32", "--snapshot-interval", "64",
                          "--page-size", "8")
    try:
        client = openai_client(server)
        name = client.models.list().data[0].id
        messages = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Hello there"}]
        first = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
        follow_up = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                {"role": "user", "content": "And then?"}]
        second = client.chat.completions.create(model=name, messages=follow_up, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
    finally:
        assert server.stop() == 0
    assert first.usage.completion_tokens == 6
    assert second.usage.model_dump()["prompt_tokens_details"]["cached_tokens"] > 0
