"""IBM Granite-4.0-H (model_type `granitemoehybrid`): Mamba2 + attention, shared MLP with optional MoE.

The computation, as transformers 5.24's `GraniteMoeHybridForCausalLM` does it (m_e, m_r, m_a, s_l are
`embedding_multiplier`, `residual_multiplier`, `attention_multiplier`, `logits_scaling`):

    x = embed(ids) * m_e                                   (in the model dtype)
    per layer i:
        x = x + m_r * mixer_i(norm_in_i(x))                mixer: Mamba2 ("mamba") or attention
        h = norm_post_i(x)
        x = x + m_r * (moe_i(h) + shared_i(h))             dense checkpoints (num_local_experts = 0): shared_i(h) only
    logits = lm_head(norm(x)) / s_l

- Norms: plain RMSNorm, weight * x / rms(x) with the statistics in fp32 and eps = `rms_norm_eps` (not the
  Qwen zero-centred 1 + weight form).
- `layer_types`: per layer "mamba" or "attention" (the published configs' names) or "linear_attention" /
  "full_attention" (what transformers 5 writes back); Granite-4.0-H-Tiny has 40 layers, attention at
  5, 15, 25, 35. Each layer has exactly one mixer and the same feed-forward block.
- Attention: q/k/v/o projections without bias, grouped-query (`num_key_value_heads`), head_dim =
  `head_dim` if given else hidden_size / num_attention_heads, no q/k norm, no output gate, softmax scale
  m_a itself (0.0078125 = 1/128 in Tiny, muP; not 1/sqrt(head_dim)). Position: `position_embedding_type`
  "rope" rotates the whole head (rotate-half, theta from `rope_parameters` / `rope_theta`); None or
  "nope" (every Granite-4.0-H checkpoint) adds no position signal at all.
- Mamba2 (cairn.layers.mamba2 with `Mamba2Spec`): heads = `mamba_n_heads`, head_dim = `mamba_d_head`
  ("auto": mamba_expand * hidden_size / heads), so intermediate = heads * head_dim; n_groups =
  `mamba_n_groups`, state_size = `mamba_d_state`, conv kernel `mamba_d_conv` with bias iff
  `mamba_conv_bias`, in_proj and out_proj bias iff `mamba_proj_bias`, chunk size `mamba_chunk_size`
  (any value gives the same result), dt limit `time_step_limit` ((0, inf): none), SiLU after the conv,
  gated RMSNorm over each of n_groups channel groups with norm_before_gate=False, i.e.
  weight * rms_norm(y * silu(z)), eps = `rms_norm_eps`. in_proj rows are [z | x B C | dt].
- Shared MLP (every layer): SwiGLU of width `shared_intermediate_size`; its `input_linear` is
  [gate rows | up rows] = cairn's fused gate_up.
- MoE (num_local_experts > 0): router logits = h W_r^T (no bias), top `num_experts_per_tok` of the
  logits, softmax over those k only (fp32, then the model dtype; equal to renormalising the full
  softmax's top k), each chosen expert a SwiGLU of width `intermediate_size`; no shared-expert gate,
  no routed scaling, no expert bias.
- Tied embeddings (`tie_word_embeddings`, true in Granite-4.0-H): lm_head is embed's weight and the
  checkpoint has no lm_head.weight.

Checkpoint tensors (names as published and as transformers' save_pretrained writes them) -> cairn:

    model.embed_tokens.weight                       [V, H]          embed.weight
    model.norm.weight                               [H]             norm.weight
    lm_head.weight (untied only)                    [V, H]          lm_head.weight
    model.layers.i.input_layernorm.weight           [H]             layers.i.input_norm.weight
    model.layers.i.post_attention_layernorm.weight  [H]             layers.i.post_norm.weight
    model.layers.i.mamba.in_proj.weight (.bias)     [2I+2GN+h, H]   layers.i.mixer.in_proj.weight (.bias)
    model.layers.i.mamba.conv1d.weight / .bias      [I+2GN, 1, K]   layers.i.mixer.conv1d.weight / .bias
    model.layers.i.mamba.{dt_bias, A_log, D}        [h]             layers.i.mixer.{dt_bias, A_log, D}
    model.layers.i.mamba.norm.weight                [I]             layers.i.mixer.norm.weight
    model.layers.i.mamba.out_proj.weight (.bias)    [H, I]          layers.i.mixer.out_proj.weight (.bias)
    model.layers.i.self_attn.{q,k,v,o}_proj.weight                  layers.i.mixer.{q,k,v,o}_proj.weight
    model.layers.i.shared_mlp.input_linear.weight   [2S, H]         layers.i.mlp.shared.gate_up.weight
    model.layers.i.shared_mlp.output_linear.weight  [H, S]          layers.i.mlp.shared.down.weight
    model.layers.i.block_sparse_moe.router.layer.weight   [E, H]    layers.i.mlp.router.weight
    model.layers.i.block_sparse_moe.input_linear.weight   [E,2F,H]  layers.i.mlp.gate_up
    model.layers.i.block_sparse_moe.output_linear.weight  [E,H,F]   layers.i.mlp.down

(I = mamba intermediate, G = n_groups, N = state size, h = mamba heads, K = conv kernel, S = shared
width, E = experts, F = expert width.) transformers 5 renames the MoE tensors in memory to
`block_sparse_moe.router.weight`, `.experts.gate_up_proj`, `.experts.down_proj`; those names are
accepted too.

Not served: the training-only router loss, and nothing else exists in these checkpoints (no vision
tower, no multi-token-prediction head).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cairn.layers.mlp import SwiGLU
from cairn.model.config import ConfigError, KeyTable, Mamba2Shape, ModelConfig, default_rope_theta, dt_limit, eos_ids
from cairn.model.hybrid import HybridModel, Target

MODEL_TYPES = ("granitemoehybrid",)

KEYS = KeyTable(
    read=frozenset({
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "layer_types",
        "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
        "position_embedding_type", "rope_parameters", "rope_theta", "rope_scaling",
        "intermediate_size", "shared_intermediate_size", "num_local_experts", "num_experts_per_tok",
        "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_head", "mamba_d_conv", "mamba_expand",
        "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit",
        "bos_token_id", "eos_token_id", "pad_token_id",
    }),
    required={
        "hidden_act": ("silu",),
        "attention_bias": (False,),
        # transformers ignores this key and always builds RMSNorm; cairn refuses what it would silently misread
        "normalization_function": ("rmsnorm",),
        "quantization_config": (None,),
    },
    # training knobs and bookkeeping
    no_effect=frozenset({
        "initializer_range", "init_method", "use_cache", "attention_dropout", "router_aux_loss_coef",
        "output_router_logits", "model_type", "architectures", "transformers_version", "torch_dtype", "dtype",
        "_name_or_path",
    }),
)
# published names ("mamba", "attention") and transformers 5's ("linear_attention", "full_attention")
LAYER_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "full_attention",
               "full_attention": "full_attention"}
POSITION_EMBEDDINGS = (None, "nope", "rope")


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict, every key checked against KEYS (transformers' defaults for absent
    keys). Raises ConfigError naming the first key that is unknown or holds a value cairn does not implement."""
    KEYS.check(raw)
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    layer_types = _layer_types(raw.get("layer_types"), int(raw["num_hidden_layers"]))
    experts = int(raw.get("num_local_experts", 8) or 0)
    rope_theta = _rope_theta(raw)
    cfg = ModelConfig(
        family="granitemoehybrid", vocab_size=int(raw.get("vocab_size", 32000)), hidden_size=hidden,
        layer_types=layer_types, ffn_types=("moe" if experts else "dense",) * len(layer_types),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(raw.get("tie_word_embeddings")),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        num_attention_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
        rope_theta=rope_theta or 10000.0, rotary_dim=head_dim if rope_theta else 0,
        attention_gated=False, attention_scale=float(raw.get("attention_multiplier", 1.0)),
        mamba=_mamba(raw, hidden),
        intermediate_size=int(raw.get("shared_intermediate_size", 1024)),  # the dense block is the shared MLP
        num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)) if experts else 0,
        moe_intermediate_size=int(raw.get("intermediate_size", 11008)) if experts else 0,
        shared_expert_intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
        zero_centred_norms=False, embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_multiplier=1.0 / float(raw.get("logits_scaling", 1.0)), eos_token_ids=eos_ids(raw),
    )
    cfg.validate()
    if experts and not 0 < cfg.num_experts_per_tok <= experts:
        raise ConfigError(f"config.json: num_experts_per_tok={cfg.num_experts_per_tok} for {experts} experts")
    return cfg


def _mamba(raw: dict[str, Any], hidden: int) -> Mamba2Shape:
    """The Mamba2 mixers' shape and options: norm(y * silu(z)) per group, eps = rms_norm_eps."""
    heads = int(raw.get("mamba_n_heads", 128))
    inner = int(raw.get("mamba_expand", 2)) * hidden
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ConfigError("config.json: mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
    bias = bool(raw.get("mamba_proj_bias", False))
    return Mamba2Shape(
        num_heads=heads, head_dim=head_dim, n_groups=int(raw.get("mamba_n_groups", 1)),
        state_size=int(raw.get("mamba_d_state", 256)), conv_kernel=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("mamba_chunk_size", 256)), norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        dt_limit=dt_limit(raw.get("time_step_limit")), conv_bias=bool(raw.get("mamba_conv_bias", True)),
        in_proj_bias=bias, out_proj_bias=bias, gated_norm=True, norm_before_gate=False)


def _layer_types(types: list[str] | None, n: int) -> tuple[str, ...]:
    """Per layer "mamba2" or "full_attention"; transformers' default (no layer_types) is all Mamba2."""
    types = ["mamba"] * n if types is None else types
    if len(types) != n:
        raise ConfigError(f"config.json: layer_types has {len(types)} entries for {n} layers")
    for t in types:
        if t not in LAYER_TYPES:
            raise ConfigError(f"config.json: layer type {t!r} is not implemented by cairn for granitemoehybrid")
    return tuple(LAYER_TYPES[t] for t in types)


def _rope_theta(raw: dict[str, Any]) -> float | None:
    """None without rope (None or "nope"); else its theta (the default rope type, over the whole head)."""
    position = raw.get("position_embedding_type")
    if position not in POSITION_EMBEDDINGS:
        raise ConfigError(f"config.json: position_embedding_type={position!r} is not implemented by cairn "
                          f"(supported: {POSITION_EMBEDDINGS})")
    if position != "rope":
        return None
    return default_rope_theta(raw)


# ---- the feed-forward block ----------------------------------------------------------------------------


class GraniteMoE(nn.Module):
    """Routed experts plus the always-on shared MLP: experts(h) + shared(h), no gate on either.

    The router keeps the top k logits and softmaxes over those k (fp32, then x's dtype). Experts are
    stacked: gate_up [E, 2 * inner, hidden] (gate rows, then up rows), down [E, hidden, inner].
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, inner: int, shared_inner: int):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self.shared = SwiGLU(hidden, shared_inner)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, experts = self.router(x).float().topk(self.top_k, dim=-1)
        weights = F.softmax(logits, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            rows, start = order[start:start + n], start + n
            if n == 0:
                continue
            tokens = rows // self.top_k
            gate, up = F.linear(x[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e])
            out.index_add_(0, tokens, y * weights.flatten()[rows].unsqueeze(-1))
        return out + self.shared(x)


class SharedMLP(nn.Module):
    """The dense checkpoints' feed-forward block: the shared MLP alone (named `shared` as in GraniteMoE)."""

    def __init__(self, hidden: int, shared_inner: int):
        super().__init__()
        self.shared = SwiGLU(hidden, shared_inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)


# a layer's feed-forward tensors (the name after `model.layers.i.`) -> its parameters in cairn
FFN_TENSORS = {
    "shared_mlp.input_linear.weight": "mlp.shared.gate_up.weight",  # [gate | up] rows, as cairn fuses them
    "shared_mlp.output_linear.weight": "mlp.shared.down.weight",
    "block_sparse_moe.router.layer.weight": "mlp.router.weight",
    "block_sparse_moe.input_linear.weight": "mlp.gate_up",
    "block_sparse_moe.output_linear.weight": "mlp.down",
    # transformers 5's in-memory names for the same three
    "block_sparse_moe.router.weight": "mlp.router.weight",
    "block_sparse_moe.experts.gate_up_proj": "mlp.gate_up",
    "block_sparse_moe.experts.down_proj": "mlp.down",
}


def ffn_targets(rest: str) -> list[Target] | None:
    """Where a layer's feed-forward tensor goes, or None when `rest` is not one."""
    return [Target(FFN_TENSORS[rest])] if rest in FFN_TENSORS else None


# ---- the model -----------------------------------------------------------------------------------------

_MAMBA_TENSORS = frozenset({"in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log",
                            "D", "norm.weight", "out_proj.weight", "out_proj.bias"})
_ATTENTION_TENSORS = frozenset({"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"})


class GraniteMoeHybridForCausalLM(HybridModel):
    """The HybridModel with plain norms, Mamba2 or plain attention per layer, and Granite's feed-forward block
    (GraniteMoE, or the shared MLP alone); the multipliers are ModelConfig's."""

    def make_mlp(self, layer: int) -> nn.Module:
        cfg = self.cfg
        if cfg.ffn_types[layer] == "moe":
            return GraniteMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                              cfg.shared_expert_intermediate_size)
        return SharedMLP(cfg.hidden_size, cfg.intermediate_size)

    def layer_targets(self, layer: int, rest: str) -> list[Target] | None:
        module, _, name = rest.partition(".")
        if module == "mamba" and self.cfg.layer_types[layer] == "mamba2" and name in _MAMBA_TENSORS:
            return [Target(f"mixer.{name}")] if self.has_parameter(f"layers.{layer}.mixer.{name}") else None
        if module == "self_attn" and self.cfg.layer_types[layer] == "full_attention" and name in _ATTENTION_TENSORS:
            return [Target(f"mixer.{name}")]
        if rest.startswith("block_sparse_moe.") and self.cfg.ffn_types[layer] != "moe":
            return None
        return self.norm_targets(rest) or ffn_targets(rest)


MODEL_CLASS = GraniteMoeHybridForCausalLM
