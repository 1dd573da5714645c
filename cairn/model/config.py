"""ModelConfig: the architecture of a hybrid checkpoint, parsed once from its Hugging Face config.json.

Model code never reads a raw HF config: `ModelConfig.from_hf` turns the JSON into one frozen dataclass
and refuses every key whose meaning cairn does not implement, naming the key. A key is either
read (it shapes the model), required to hold one value (e.g. `hidden_act` must be `silu`), known to
have no effect on inference (training-only or multimodal), or unknown, which is an error.

The config also hands each layer its own small spec (`attention_spec`, `gated_deltanet_spec`), so that
layers never read a ModelConfig, and describes the recurrent state as named per-layer tensors
(`state_spec`), from which the state pools, snapshot tiers and disk segments are laid out.

This module is not the loader: it never touches weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from cairn.layers.attention import AttentionSpec
    from cairn.layers.gated_deltanet import GatedDeltaNetSpec
    from cairn.memory.state_spec import StateSpec

log = logging.getLogger(__name__)

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_TEXT_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}

# Keys that shape the text model; read below.
_READ_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "rope_parameters", "rope_theta", "partial_rotary_factor", "rope_scaling", "layer_types",
    "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "bos_token_id", "eos_token_id", "pad_token_id",
}
# Keys whose value cairn implements exactly one way; any other value is refused.
_REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "attn_output_gate": (True,),
    "attention_bias": (False,),
    "mamba_ssm_dtype": ("float32",),
    "use_sliding_window": (False,),
    "quantization_config": (None,),
}
# Keys with no effect on text inference: training knobs, bookkeeping, and the multi-token-prediction
# head (whose weights the loader skips and logs).
_NO_EFFECT_KEYS = {
    "initializer_range", "use_cache", "attention_dropout", "router_aux_loss_coef", "output_router_logits",
    "model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings", "sliding_window", "max_window_layers", "mrope_section",
    "mrope_interleaved", "_name_or_path", "base_config_key",
}
# Outer keys of the multimodal wrapper (qwen3_5, qwen3_5_moe): the vision tower is not served.
_WRAPPER_KEYS = {
    "architectures", "model_type", "text_config", "vision_config", "image_token_id", "video_token_id",
    "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings", "transformers_version",
    "torch_dtype", "dtype", "_name_or_path",
}


class ConfigError(ValueError):
    """A checkpoint's config asks for something cairn does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one hybrid model. Sizes are counts, dims are elements per vector."""

    family: str  # one of FAMILIES; selects the model file
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (Gated DeltaNet) or "full_attention"
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # full attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int  # leading dims of each head that are rotated (partial rotary)
    # Gated DeltaNet
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_head_dim: int
    linear_v_head_dim: int
    conv_kernel: int
    # feed-forward
    intermediate_size: int  # dense MLP width (layers that are not MoE)
    moe_layers: tuple[bool, ...] = ()  # per layer: True when the layer's MLP is a sparse MoE block
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # tensor names and tokens
    weight_prefix: str = "model."  # prefix of the text model's tensors in the checkpoint
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_k_heads * self.linear_k_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_v_heads * self.linear_v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    # The layer specs are imported where they are built: parsing a config (preflight) must not load torch.

    def attention_spec(self) -> AttentionSpec:
        from cairn.layers.attention import AttentionSpec

        return AttentionSpec(self.hidden_size, self.num_attention_heads, self.num_kv_heads, self.head_dim,
                             self.rms_norm_eps)

    def gated_deltanet_spec(self) -> GatedDeltaNetSpec:
        from cairn.layers.gated_deltanet import GatedDeltaNetSpec

        return GatedDeltaNetSpec(self.hidden_size, self.linear_num_k_heads, self.linear_num_v_heads,
                                 self.linear_k_head_dim, self.linear_v_head_dim, self.conv_kernel, self.rms_norm_eps)

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        """Every recurrent layer's state per slot, for a model computing in `dtype`."""
        from cairn.memory.state_spec import LayerState, StateSpec

        gdn = self.gated_deltanet_spec().state_entries(dtype)
        return StateSpec(tuple(LayerState(layer, gdn) for layer in self.linear_layers))

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict (flat text layout or the multimodal `text_config` wrapper)."""
        model_type = raw.get("model_type")
        if model_type not in _TEXT_MODEL_TYPES:
            raise ConfigError(f"config.json: model_type {model_type!r} is not supported; cairn serves "
                              f"{sorted(_TEXT_MODEL_TYPES)}")
        family = _TEXT_MODEL_TYPES[model_type]
        if "text_config" in raw:
            _check_wrapper(raw)
            text = dict(raw["text_config"])
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            prefix = "model.language_model."
        else:
            text, prefix = raw, "model."
        _check_keys(text)
        return _build(family, text, prefix)


def _check_wrapper(raw: dict[str, Any]) -> None:
    for key in raw:
        if key not in _WRAPPER_KEYS:
            raise ConfigError(f"config.json: key {key!r} is not implemented by cairn")
    if raw.get("vision_config") is not None:
        log.info("config.json has a vision tower: cairn serves text only and skips model.visual.*")


def _check_keys(text: dict[str, Any]) -> None:
    for key, value in text.items():
        if key in _READ_KEYS or key in _NO_EFFECT_KEYS:
            continue
        if key in _REQUIRED_VALUES:
            if value not in _REQUIRED_VALUES[key]:
                raise ConfigError(f"config.json: {key}={value!r} is not implemented by cairn "
                                  f"(supported: {_REQUIRED_VALUES[key]})")
            continue
        raise ConfigError(f"config.json: key {key!r} is not implemented by cairn")
    if text.get("mtp_num_hidden_layers"):
        log.info("config.json has %d multi-token-prediction layer(s): skipped (mtp.* weights are not loaded)",
                 text["mtp_num_hidden_layers"])


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


def _moe_layers(family: str, text: dict[str, Any], n: int) -> tuple[bool, ...]:
    if family == "qwen3_5":
        return (False,) * n
    if family == "qwen3_5_moe":
        return (True,) * n
    step = int(text.get("decoder_sparse_step", 1))
    dense = set(text.get("mlp_only_layers") or [])
    experts = int(text.get("num_experts", 0))
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))


def _build(family: str, text: dict[str, Any], prefix: str) -> ModelConfig:
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    theta, rotary_dim = _rope(text, head_dim)
    layer_types = _layer_types(text)
    eos = text.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    moe_layers = _moe_layers(family, text, len(layer_types))
    if family == "qwen3_5_moe" and text.get("norm_topk_prob", True) is not True:
        raise ConfigError("config.json: norm_topk_prob=False is not implemented for qwen3_5_moe")
    cfg = ModelConfig(
        family=family,
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        layer_types=layer_types,
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
        moe_layers=moe_layers,
        num_experts=int(text.get("num_experts", 0) or 0) if any(moe_layers) else 0,
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0) if any(moe_layers) else 0,
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        weight_prefix=prefix,
        eos_token_ids=eos_ids,
    )
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    if cfg.num_attention_heads % cfg.num_kv_heads:
        raise ConfigError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.linear_num_v_heads % cfg.linear_num_k_heads:
        raise ConfigError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.head_dim:
        raise ConfigError("config.json: partial_rotary_factor gives an odd or oversized rotary dim")
    if not cfg.linear_layers:
        log.warning("model has no linear-attention layers: it is not hybrid, snapshots will be empty")
