"""Qwen3.5 dense (model_type `qwen3_5` with nested `text_config`, or `qwen3_5_text`), and the config parser
shared by the three Qwen hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

Every layer has a dense SwiGLU MLP; three Gated DeltaNet layers to one gated attention layer by
default (`layer_types`). The checkpoint's Gated DeltaNet projections are separate (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a) and are fused into one in_proj at load time. Weights sit under
`model.language_model.` in the multimodal layout and under `model.` in the text-only one.
"""

from __future__ import annotations

import logging
from typing import Any

from cairn.model.config import ConfigError, KeyTable, ModelConfig, eos_ids
from cairn.model.hybrid import HybridModel

log = logging.getLogger(__name__)

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

KEYS = KeyTable(
    read=frozenset({
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "rope_parameters", "rope_theta", "partial_rotary_factor", "rope_scaling", "layer_types",
        "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
        "mlp_only_layers", "bos_token_id", "eos_token_id", "pad_token_id",
    }),
    required={
        "hidden_act": ("silu",),
        "attn_output_gate": (True,),
        "attention_bias": (False,),
        "mamba_ssm_dtype": ("float32",),
        "use_sliding_window": (False,),
        "quantization_config": (None,),
    },
    # training knobs, bookkeeping, and the multi-token-prediction head (whose weights the loader skips)
    no_effect=frozenset({
        "initializer_range", "use_cache", "attention_dropout", "router_aux_loss_coef", "output_router_logits",
        "model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "mtp_num_hidden_layers",
        "mtp_use_dedicated_embeddings", "sliding_window", "max_window_layers", "mrope_section",
        "mrope_interleaved", "_name_or_path", "base_config_key",
    }),
)
# Outer keys of the multimodal wrapper (qwen3_5, qwen3_5_moe): the vision tower is not served.
_WRAPPER_KEYS = {
    "architectures", "model_type", "text_config", "vision_config", "image_token_id", "video_token_id",
    "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings", "transformers_version",
    "torch_dtype", "dtype", "_name_or_path",
}


class Qwen3_5ForCausalLM(HybridModel):
    """The HybridModel as is: dense MLPs, split Gated DeltaNet projections."""


MODEL_CLASS = Qwen3_5ForCausalLM


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    return parse_qwen_config(raw, "qwen3_5")


def parse_qwen_config(raw: dict[str, Any], family: str) -> ModelConfig:
    """Parse a Qwen hybrid config.json dict (flat text layout or the multimodal `text_config` wrapper)."""
    if "text_config" in raw:
        _check_wrapper(raw)
        text = dict(raw["text_config"])
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        prefix = "model.language_model."
    else:
        text, prefix = raw, "model."
    KEYS.check(text)
    if text.get("mtp_num_hidden_layers"):
        log.info("config.json has %d multi-token-prediction layer(s): skipped (mtp.* weights are not loaded)",
                 text["mtp_num_hidden_layers"])
    return _build(family, text, prefix)


def _check_wrapper(raw: dict[str, Any]) -> None:
    for key in raw:
        if key not in _WRAPPER_KEYS:
            raise ConfigError(f"config.json: key {key!r} is not implemented by cairn")
    if raw.get("vision_config") is not None:
        log.info("config.json has a vision tower: cairn serves text only and skips model.visual.*")


def _rope(text: dict[str, Any], head_dim: int) -> tuple[float, int]:
    """(rope_theta, rotary_dim) from either `rope_parameters` or the older flat keys."""
    params = dict(text.get("rope_parameters") or {})
    scaling = text.get("rope_scaling")
    if scaling:
        params = {**scaling, **params}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config.json: rope_type={rope_type!r} is not implemented by cairn (only 'default')")
    for key in params:
        if key not in ("rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section",
                       "mrope_interleaved"):
            raise ConfigError(f"config.json: rope_parameters.{key} is not implemented by cairn")
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    return theta, int(head_dim * factor)


def _layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    n = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"config.json: layer_types has {len(types)} entries for {n} layers")
    for t in types:
        if t not in ("linear_attention", "full_attention"):
            raise ConfigError(f"config.json: layer type {t!r} is not implemented by cairn")
    return tuple(types)


def _ffn_types(family: str, text: dict[str, Any], n: int) -> tuple[str, ...]:
    if family == "qwen3_5":
        return ("dense",) * n
    if family == "qwen3_5_moe":
        return ("moe",) * n
    step = int(text.get("decoder_sparse_step", 1))
    dense = set(text.get("mlp_only_layers") or [])
    experts = int(text.get("num_experts", 0))
    return tuple("moe" if i not in dense and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n))


def _build(family: str, text: dict[str, Any], prefix: str) -> ModelConfig:
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    theta, rotary_dim = _rope(text, head_dim)
    layer_types = _layer_types(text)
    ffn_types = _ffn_types(family, text, len(layer_types))
    if family == "qwen3_5_moe" and text.get("norm_topk_prob", True) is not True:
        raise ConfigError("config.json: norm_topk_prob=False is not implemented for qwen3_5_moe")
    moe = "moe" in ffn_types
    cfg = ModelConfig(
        family=family,
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        layer_types=layer_types,
        ffn_types=ffn_types,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        num_attention_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rope_theta=theta,
        rotary_dim=rotary_dim,
        linear_num_k_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_v_heads=int(text.get("linear_num_value_heads", 32)),
        linear_k_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_v_head_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(text.get("intermediate_size", 0) or 0),
        num_experts=int(text.get("num_experts", 0) or 0) if moe else 0,
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0) if moe else 0,
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        weight_prefix=prefix,
        eos_token_ids=eos_ids(text),
    )
    cfg.validate()
    return cfg
