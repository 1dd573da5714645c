"""Nemotron-H and Nemotron 3 (model_type `nemotron_h`): Mamba2 hybrids of single-op layers.

Each layer is one pre-norm residual block holding ONE op, named by a character of
`hybrid_override_pattern` (or an entry of `layers_block_type` / `layer_types` in newer configs):

    M  Mamba2 mixer        -> layer_types "mamba2",          ffn_types "none"
    *  attention (no RoPE) -> layer_types "full_attention",  ffn_types "none"
    -  squared-ReLU MLP    -> layer_types "none",            ffn_types "dense"
    E  MoE                 -> layer_types "none",            ffn_types "moe"

Norms are plain RMSNorms (x / rms(x) * w); attention is plain GQA without rotary, q/k norm or gate; the
Mamba2 mixer's gated group norm multiplies by silu(z) before normalising, and its step size is clamped
to `time_step_limit` ((0, inf) unless the config says otherwise: NVIDIA's own implementation, and
transformers' from 5.25; `time_step_min` only initialises dt_bias, though transformers before 5.25
clamped at it). The MoE is DeepSeek-V3-style: sigmoid router with a score-correction bias and
group-limited choice, squared-ReLU experts, a shared expert, optionally a latent width for the experts
(cairn.layers.mlp.SigmoidMoE).

Checkpoint tensors sit under `backbone.` (NVIDIA's checkpoints) or `model.` (transformers'
save_pretrained); the layer's one norm is `layers.{i}.norm` and its one op is `layers.{i}.mixer`,
whatever it is. Experts come per expert (`mixer.experts.{e}.up_proj.weight`) or stacked
(`mixer.experts.up_proj` [E, inner, hidden]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from cairn.layers.mlp import ReluSquaredMLP, SigmoidMoE
from cairn.model.config import ConfigError, KeyTable, Mamba2Shape, ModelConfig, dt_limit, eos_ids
from cairn.model.hybrid import HybridModel, Target

MODEL_TYPES = ("nemotron_h",)

KEYS = KeyTable(
    read=frozenset({
        "vocab_size", "hidden_size", "hybrid_override_pattern", "layers_block_type", "layer_types",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "attention_head_dim",
        "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "layer_norm_epsilon",
        "rms_norm_eps", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "mamba_n_groups",
        "conv_kernel", "mamba_d_conv", "chunk_size", "mamba_chunk_size", "use_conv_bias", "mamba_conv_bias",
        "use_bias", "mamba_proj_bias", "time_step_limit", "mamba_dt_limit", "n_routed_experts", "num_experts_per_tok",
        "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_group", "topk_group", "norm_topk_prob",
        "routed_scaling_factor", "moe_latent_size", "bos_token_id", "eos_token_id", "pad_token_id",
    }),
    required={
        "mlp_hidden_act": ("relu2",),
        "mamba_hidden_act": ("silu",),
        "attention_bias": (False,),
        "mlp_bias": (False,),
        "mamba_ssm_cache_dtype": ("float32",),
        "n_shared_experts": (1,),
        "residual_in_fp32": (False,),
        "sliding_window": (None,),
        "quantization_config": (None,),
    },
    # training knobs (initialisation, dropout, the dt init range), bookkeeping, and switches of the
    # implementation (kernels, logits kept) that do not change what is computed
    no_effect=frozenset({
        "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "output_router_logits",
        "model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
        "num_logits_to_keep", "time_step_min", "time_step_max", "time_step_floor", "mamba_dt_min",
        "mamba_dt_max", "mamba_dt_init_floor", "expand", "mamba_expand", "rescale_prenorm_residual",
        "use_mamba_kernels", "moe_shared_expert_overlap", "mtp_layers_block_type", "mtp_hybrid_override_pattern",
    }),
    refused={"num_nextn_predict_layers": "multi-token-prediction layers are not implemented"},
)

# op name (pattern character, or a layers_block_type entry) -> (mixer, ffn)
_OPS = {
    "M": ("mamba2", "none"), "*": ("full_attention", "none"), "-": ("none", "dense"), "E": ("none", "moe"),
    "mamba": ("mamba2", "none"), "linear_attention": ("mamba2", "none"), "attention": ("full_attention", "none"),
    "full_attention": ("full_attention", "none"), "mlp": ("none", "dense"), "moe": ("none", "moe"),
}


@dataclass(frozen=True)
class NemotronHConfig(ModelConfig):
    """ModelConfig plus the routing of Nemotron's MoE layers (see cairn.layers.mlp.SigmoidMoE)."""

    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    moe_latent_size: int | None = None


def parse_config(raw: dict[str, Any]) -> NemotronHConfig:
    KEYS.check(raw)
    ops = _ops(raw)
    hidden = int(raw["hidden_size"])
    heads = int(raw.get("num_attention_heads", 32))
    mamba = Mamba2Shape(
        num_heads=int(raw.get("mamba_num_heads", 128)), head_dim=int(raw.get("mamba_head_dim", 64)),
        n_groups=int(_first(raw, "n_groups", "mamba_n_groups", 8)), state_size=int(raw.get("ssm_state_size", 128)),
        conv_kernel=int(_first(raw, "conv_kernel", "mamba_d_conv", 4)),
        chunk_size=int(_first(raw, "chunk_size", "mamba_chunk_size", 128)),
        norm_eps=float(_first(raw, "layer_norm_epsilon", "rms_norm_eps", 1e-5)),
        dt_limit=dt_limit(_first(raw, "time_step_limit", "mamba_dt_limit", None)),
        conv_bias=bool(_first(raw, "use_conv_bias", "mamba_conv_bias", True)),
        in_proj_bias=bool(raw.get("use_bias", False)), out_proj_bias=bool(raw.get("use_bias", False)))
    cfg = NemotronHConfig(
        family="nemotron_h", vocab_size=int(raw.get("vocab_size", 131072)), hidden_size=hidden,
        layer_types=tuple(m for m, _ in ops), ffn_types=tuple(f for _, f in ops),
        rms_norm_eps=mamba.norm_eps, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        num_attention_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(_first(raw, "head_dim", "attention_head_dim", 0) or hidden // heads),
        rotary_dim=0, attention_gated=False, mamba=mamba, zero_centred_norms=False,
        intermediate_size=int(raw.get("intermediate_size", 21504)),
        num_experts=int(raw.get("n_routed_experts", 8)), num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 7688)),
        shared_expert_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size", 7688)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        weight_prefix="backbone.", eos_token_ids=eos_ids(raw),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)), n_group=int(raw.get("n_group", 1)),
        topk_group=int(raw.get("topk_group", 1)), moe_latent_size=raw.get("moe_latent_size"))
    cfg.validate()
    if "moe" in cfg.ffn_types and cfg.num_experts % cfg.n_group:
        raise ConfigError("config.json: n_routed_experts must be a multiple of n_group")
    return cfg


def _first(raw: dict[str, Any], key: str, alias: str, default: Any) -> Any:
    """The value under `key`, else under its older alias, else `default`."""
    for k in (key, alias):
        if raw.get(k) is not None:
            return raw[k]
    return default


def _ops(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """(mixer, ffn) per layer from the pattern string or the list of block types."""
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    ops = listed if listed is not None else list(raw.get("hybrid_override_pattern") or "")
    if not ops:
        raise ConfigError("config.json: nemotron_h needs hybrid_override_pattern (or layers_block_type)")
    unknown = sorted({op for op in ops if op not in _OPS})
    if unknown:
        raise ConfigError(f"config.json: nemotron_h layer kind(s) {unknown} are not implemented by cairn")
    n = raw.get("num_hidden_layers")
    if listed is None and n is not None and int(n) != len(ops):
        raise ConfigError(f"config.json: hybrid_override_pattern has {len(ops)} layers, num_hidden_layers {n}")
    return [_OPS[op] for op in ops]


class NemotronHForCausalLM(HybridModel):
    """Single-op layers: the mixer's norm is `input_norm`, the FFN's is `post_norm` (the one present)."""

    cfg: NemotronHConfig

    def make_mlp(self, layer: int) -> nn.Module | None:
        cfg, kind = self.cfg, self.cfg.ffn_types[layer]
        if kind == "dense":
            return ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size)
        if kind == "moe":
            return SigmoidMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                              cfg.shared_expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                              routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
                              topk_group=cfg.topk_group, latent=cfg.moe_latent_size)
        return None

    def targets(self, name: str) -> list[Target] | None:
        top = {"embeddings.weight": "embed.weight", "norm_f.weight": "norm.weight"}
        m = re.fullmatch(r"(?:backbone|model)\.(.+)", name)
        if m and m.group(1) in top:
            return [Target(top[m.group(1)])]
        if name == "lm_head.weight":
            return [] if self.cfg.tie_word_embeddings else [Target("lm_head.weight")]
        m = re.fullmatch(r"(?:backbone|model)\.layers\.(\d+)\.(.+)", name)
        if not m or int(m.group(1)) >= self.cfg.num_layers:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        found = self.layer_targets(layer, rest)
        return None if found is None else [Target(f"layers.{layer}." + t.param, t.region, t.transform) for t in found]

    def layer_targets(self, layer: int, rest: str) -> list[Target] | None:
        has_mixer = self.cfg.layer_types[layer] != "none"
        if rest == "norm.weight":
            return [Target("input_norm.weight" if has_mixer else "post_norm.weight")]
        if not rest.startswith("mixer."):
            return None
        if has_mixer:  # Mamba2 and attention parameters carry the checkpoint's own names
            return [Target(rest)] if self.has_parameter(f"layers.{layer}.{rest}") else None
        return _ffn_targets(rest[len("mixer."):])


_MOE_NAMES = {
    "gate.weight": "mlp.router.weight", "gate.e_score_correction_bias": "mlp.score_bias",
    "experts.up_proj": "mlp.up", "experts.down_proj": "mlp.down",
    "shared_experts.up_proj.weight": "mlp.shared.up.weight",
    "shared_experts.down_proj.weight": "mlp.shared.down.weight",
    "fc1_latent_proj.weight": "mlp.latent_in.weight", "fc2_latent_proj.weight": "mlp.latent_out.weight",
    "up_proj.weight": "mlp.up.weight", "down_proj.weight": "mlp.down.weight",  # a dense (-) layer
}


def _ffn_targets(rest: str) -> list[Target] | None:
    if rest in _MOE_NAMES:
        return [Target(_MOE_NAMES[rest])]
    m = re.fullmatch(r"experts\.(\d+)\.(up_proj|down_proj)\.weight", rest)
    if m:
        return [Target("mlp.up" if m.group(2) == "up_proj" else "mlp.down", (int(m.group(1)),))]
    return None


MODEL_CLASS = NemotronHForCausalLM
