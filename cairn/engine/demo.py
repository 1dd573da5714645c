"""The built-in demo models, by name: the trained one cairn ships, and one with deterministic random weights.

`cairn-demo` (DEMO_NAME, what `cairn serve` and `cairn generate` serve when no --model is given) is
a small Qwen3.5-architecture checkpoint trained on a CPU (cairn/demo/: its corpus and training) and
shipped in the package at DEMO_CHECKPOINT; it is loaded as any Hugging Face checkpoint is, after
its files are checked against the SHA256SUMS written beside them. `cairn-demo-random`
(RANDOM_DEMO_NAME, also what the library builds when no model is given: `LLM()`, `EngineConfig()`)
has the same shape, a byte tokenizer and random weights from --demo-seed: its text is meaningless,
and it exercises every part of the engine and the cache exactly as a real checkpoint does.
"""

from __future__ import annotations

import math

import torch

from cairn.config import DEMO_NAME, RANDOM_DEMO_NAME, is_random_demo
from cairn.model.config import ModelConfig
from cairn.model.demo_checkpoint import DEMO_CHECKPOINT, demo_checkpoint
from cairn.model.families import family_of
from cairn.model.hybrid import HybridModel
from cairn.model.loader import build_model
from cairn.request.tokenizer import ByteTokenizer

__all__ = ["DEMO_NAME", "RANDOM_DEMO_NAME", "DEMO_CHECKPOINT", "demo_checkpoint", "is_demo", "demo_config",
           "init_random_weights", "build_demo"]


def is_demo(model: str | None) -> bool:
    """Whether `model` (--model) names one of the built-in demo models (None: the random one)."""
    return model == DEMO_NAME or is_random_demo(model)


def demo_config(vocab_size: int) -> ModelConfig:
    """Eight layers, three Gated DeltaNet to one gated attention, as in Qwen3.5."""
    return ModelConfig(
        family=family_of("qwen3_5_text"), vocab_size=vocab_size, hidden_size=256,
        layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",),
        ffn_types=("dense",) * 8,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=65536,
        num_attention_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10_000_000.0, rotary_dim=16,
        linear_num_k_heads=2, linear_num_v_heads=4, linear_k_head_dim=64, linear_v_head_dim=64, conv_kernel=4,
        intermediate_size=768, eos_token_ids=ByteTokenizer().eos_token_ids,
    )


def init_random_weights(model: HybridModel, seed: int, std: float = 0.02) -> None:
    """Hugging Face-style initialisation, deterministic from `seed` whatever the device."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(("input_norm.weight", "post_norm.weight", "q_norm.weight", "k_norm.weight")) \
                or name == "norm.weight":
            value = torch.zeros(param.shape)  # zero-centred RMSNorm: scale 1
        elif name.endswith("mixer.norm.weight") or name.endswith("dt_bias"):
            value = torch.ones(param.shape)
        elif name.endswith("A_log"):
            value = torch.empty(param.shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("conv_weight"):
            bound = 1.0 / math.sqrt(param.shape[-1])
            value = torch.empty(param.shape).uniform_(-bound, bound, generator=gen)
        else:
            value = torch.empty(param.shape).normal_(0.0, std, generator=gen)
        with torch.no_grad():
            param.copy_(value)


def build_demo(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[HybridModel, ModelConfig, ByteTokenizer]:
    tokenizer = ByteTokenizer()
    cfg = demo_config(tokenizer.vocab_size)
    model = build_model(cfg, dtype, device)
    init_random_weights(model, seed)
    return model, cfg, tokenizer
