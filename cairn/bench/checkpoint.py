"""Random-weight Hugging Face checkpoints at a named size, for `cairn bench --size`, the benchmarks
and the tests.

    make_checkpoint("0.8b", path)    Qwen3.5-0.8B's dimensions (vocabulary cut to 32k), random weights
    write_tokenizer(path)            a byte-level tokenizer.json with a ChatML chat template

The weights are written by transformers' own `save_pretrained` (transformers is the `bench` / `test`
extra, imported only here, when called), so cairn's loader reads them exactly as it reads a real
checkpoint. `SIZES` holds the named sizes:

    tiny   hidden 256, 8 layers (6 Gated DeltaNet + 2 gated attention), vocabulary 4096
    0.8b   hidden 1024, 24 layers (18 + 6), 16 value heads of 128, 8 query / 2 KV heads of 256,
           intermediate 3584; the vocabulary is 32k instead of 248k, which changes only the lm_head cost
    0.8b-skeleton  the 0.8b's 24 layers in the same order and kinds, at hidden 64 and heads of 16 / 32, vocabulary
           512: a decode step whose arithmetic and memory traffic are negligible, so its time is what a 0.8b step
           costs besides them (Python, dispatch, op calls; benchmarks/decode_profile.py --size 0.8b-skeleton)
    nemotron-h-tiny  Nemotron-H, hidden 256, 8 single-op layers M-M*M-M* (Mamba2 8 heads of 32, state 32;
           attention 4 query / 2 KV heads of 64; squared-ReLU MLP 768), vocabulary 4096
    nemotron-h-4b    Nemotron-H-4B's dimensions: hidden 3072, 52 layers (24 Mamba2 of 112 heads x 64, state
           128, 8 groups; 4 attention of 32 / 8 KV heads of 128; 24 MLP of 12288), vocabulary 32k (not 131k)
    nemotron-h-4b-slice  the same layers, 6 of them (M-M*M-: 3 Mamba2, 1 attention, 2 MLP): per-layer speed
           at the 4B dimensions on a machine without room for two copies of the whole model
    falcon-h1-0.5b  Falcon-H1-0.5B's config.json: hidden 1024, 36 parallel attention + Mamba2 layers (24 heads
           of 64, state 128, 1 group; 8 query / 2 KV heads of 64), MLP 2048, its multipliers, vocabulary 32,784
    granite-4.0-h-350m  Granite-4.0-H-350M's config.json: hidden 768, 32 layers (28 Mamba2 of 48 heads x 32,
           state 128; 4 NoPE attention of 12 query / 4 KV heads), dense shared MLP 2048, vocabulary 100,352

`make_checkpoint(size, path, dtype)` builds and saves the weights in `dtype` (fp32 unless given; no fp32
copy is ever made: the 4B model is 7.5 GB in bf16, 15 GB in fp32).

What it is not: a model anyone should generate text with (the weights are random), nor the tests'
tiny per-family checkpoints (tests/checkpoints.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a checkpoint is made, not by `cairn --help` (SIZES is read there)
    import torch

_QWEN = {
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64),
    "0.8b": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128),
    "0.8b-skeleton": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                          linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
}
_NEMOTRON_H = {
    "nemotron-h-tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768,
                            hybrid_override_pattern="M-M*M-M*", num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=32,
                            chunk_size=64),
    "nemotron-h-4b": dict(vocab_size=32768, hidden_size=3072, intermediate_size=12288,
                          hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=112,
                          mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=128),
}
_NEMOTRON_H["nemotron-h-4b-slice"] = dict(_NEMOTRON_H["nemotron-h-4b"], hybrid_override_pattern="M-M*M-")
_FALCON_H1 = {
    "falcon-h1-0.5b": dict(
        vocab_size=32784, hidden_size=1024, intermediate_size=2048, num_hidden_layers=36, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_chunk_size=128, mamba_rms_norm=False,
        mamba_norm_before_gate=False, mamba_proj_bias=False, projectors_bias=False, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e11}, attention_in_multiplier=1.0,
        attention_out_multiplier=0.9375, embedding_multiplier=5.656854249492381, key_multiplier=0.390625,
        lm_head_multiplier=0.0390625, mlp_multipliers=[0.8838834764831844, 0.5859375], ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.23570226039551587,
        ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738]),
}
_GRANITE = {
    "granite-4.0-h-350m": dict(
        vocab_size=100352, hidden_size=768, num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4,
        layer_types=["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)], mamba_n_heads=48,
        mamba_d_head=32, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
        mamba_conv_bias=True, mamba_proj_bias=False, num_local_experts=0, num_experts_per_tok=0,
        intermediate_size=2048, shared_intermediate_size=2048, position_embedding_type="nope", rms_norm_eps=1e-5,
        tie_word_embeddings=True, embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.246,
        logits_scaling=3.0),
}
_NO_SPECIAL_TOKENS = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
# config.json's model_type (transformers' name for the architecture; cairn/model/families.py maps it to the family
# that serves it: this file names no family) -> its named sizes, and what each of its configs adds
_ARCHITECTURES = {
    "qwen3_5_text": (_QWEN, dict(linear_conv_kernel_dim=4)),
    "nemotron_h": (_NEMOTRON_H, dict(conv_kernel=4, **_NO_SPECIAL_TOKENS)),
    "falcon_h1": (_FALCON_H1, _NO_SPECIAL_TOKENS),
    "granitemoehybrid": (_GRANITE, _NO_SPECIAL_TOKENS),
}
_MODEL_TYPE = {size: model_type for model_type, (sizes, _) in _ARCHITECTURES.items() for size in sizes}
SIZES = tuple(_MODEL_TYPE)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_checkpoint(size: str, path: Path, dtype: torch.dtype | None = None):
    """Write a checkpoint of `size` (one of SIZES: seed 0, weights made and saved in `dtype`, fp32 if None) and a
    byte-level tokenizer to `path`; returns the transformers model (eval mode)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(hf_config(size), dtype=dtype or torch.float32).eval()
    model.save_pretrained(str(path))
    write_tokenizer(path)
    return model


def hf_config(size: str):
    """The transformers config of `size`, of the class transformers registers for its model_type (its model class
    follows from it; max_position_embeddings 32768: room for the 8k-token published workloads; no special token
    ids but Qwen3.5's defaults: the byte tokenizer's eos is <|im_end|>)."""
    import transformers as tf

    model_type = _MODEL_TYPE[size]
    sizes, extra = _ARCHITECTURES[model_type]
    return tf.AutoConfig.for_model(model_type, **sizes[size], **extra, initializer_range=0.02,
                                   max_position_embeddings=32768)


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer without merges (one token per byte, then SPECIALS) and a ChatML
    chat template, as tokenizer.json and tokenizer_config.json in `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_vocab = {tok: i for i, tok in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
