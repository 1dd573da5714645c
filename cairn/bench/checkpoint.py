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
    nemotron-h-tiny  Nemotron-H, hidden 256, 8 single-op layers M-M*M-M* (Mamba2 8 heads of 32, state 32;
           attention 4 query / 2 KV heads of 64; squared-ReLU MLP 768), vocabulary 4096
    nemotron-h-4b    Nemotron-H-4B's dimensions: hidden 3072, 52 layers (24 Mamba2 of 112 heads x 64, state
           128, 8 groups; 4 attention of 32 / 8 KV heads of 128; 24 MLP of 12288), vocabulary 32k (not 131k)
    nemotron-h-4b-slice  the same layers, 6 of them (M-M*M-: 3 Mamba2, 1 attention, 2 MLP): per-layer speed
           at the 4B dimensions on a machine without room for two copies of the whole model

What it is not: a model anyone should generate text with (the weights are random), nor the tests'
tiny per-family checkpoints (tests/checkpoints.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_QWEN = {
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64),
    "0.8b": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128),
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
SIZES = (*_QWEN, *_NEMOTRON_H)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_checkpoint(size: str, path: Path):
    """Write a checkpoint of `size` (one of SIZES: fp32, seed 0) and a byte-level tokenizer to `path`;
    returns the transformers model."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = hf_config(size)
    model = (tf.NemotronHForCausalLM(cfg) if size in _NEMOTRON_H else tf.Qwen3_5ForCausalLM(cfg)).eval()
    model.save_pretrained(str(path))
    write_tokenizer(path)
    return model


def hf_config(size: str):
    """The transformers config of `size` (max_position_embeddings 32768: room for the 8k-token published
    workloads)."""
    import transformers as tf

    if size in _NEMOTRON_H:  # no special token ids: the byte tokenizer's eos is <|im_end|>
        return tf.NemotronHConfig(**_NEMOTRON_H[size], conv_kernel=4, initializer_range=0.02,
                                  max_position_embeddings=32768, eos_token_id=None, bos_token_id=None,
                                  pad_token_id=None)
    return tf.Qwen3_5TextConfig(**_QWEN[size], linear_conv_kernel_dim=4, initializer_range=0.02,
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
