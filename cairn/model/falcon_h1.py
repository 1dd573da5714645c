"""Falcon-H1 (TII, model_type `falcon_h1`): attention and Mamba2 side by side in every layer.

What transformers 5.24 (`models/falcon_h1/modeling_falcon_h1.py`) computes, and cairn with it. Every
layer is "hybrid": it holds one attention mixer (a KV cache) AND one Mamba2 mixer (a conv state and an
SSM state), both reading the same normed input; no layer is attention-only or SSM-only.

    x = embed_tokens(ids) * embedding_multiplier
    for each layer:
        h = input_layernorm(x)                                     plain RMSNorm: w * x / rms(x), eps rms_norm_eps
        m = mamba(h)                                               see below
        a = attention(h * attention_in_multiplier)                 see below
        x = x + m * ssm_out_multiplier + a * attention_out_multiplier
        g = pre_ff_layernorm(x)
        x = x + down_proj(up_proj(g) * silu(gate_proj(g) * mlp_multipliers[0])) * mlp_multipliers[1]
    logits = lm_head(final_layernorm(x)) * lm_head_multiplier     lm_head = embed_tokens when tied

Mamba2 mixer (cairn.layers.mamba2 with the Falcon-H1 options of its Mamba2Spec):

    [z | xBC | dt] = in_proj(h * ssm_in_multiplier) * mup       mup: ssm_multipliers[0..4] on the z, x, B, C
                                                                 and dt segments of the projection
    xBC = silu(causal depthwise conv1d over mamba_d_conv taps)   conv state: the last K-1 xBC rows
    y   = SSD scan: dt' = clamp(softplus(dt + dt_bias), time_step_limit), A = -exp(A_log), B/C per group
          (mamba_n_groups), D skip; state [mamba_n_heads, mamba_d_head, mamba_d_state] in fp32
    y   = mamba_rms_norm ?  norm(y, z)  :  y * silu(z)
          norm: RMSNorm over each group's channels (eps rms_norm_eps), gated by silu(z):
          mamba_norm_before_gate=True: w * rms(y) * silu(z); False: w * rms(y * silu(z))
    m   = out_proj(y)

    widths: inner = mamba_d_ssm (absent: 1024, the transformers default; null: mamba_expand * hidden_size),
    mamba_d_head = inner / mamba_n_heads ("auto"), conv channels = inner + 2 * n_groups * d_state,
    in_proj rows = inner (z) + conv channels (x, B, C) + n_heads (dt).
    transformers clamps dt by time_step_limit in its chunked prefill but not in its decode step; cairn
    clamps in both (one recurrence), which equals transformers whenever the limit is (0, inf), the default.
    In half precision transformers' `mup_vector` is an fp32 buffer, so the rest of its mixer runs on fp32
    activations; cairn scales in fp32 and rounds once to the model dtype (the logits differ from
    transformers' by about as much as transformers' half-precision logits differ from its fp32 ones).

Attention (plain grouped-query attention, no q/k norm, no output gate):

    q = q_proj(h'), k = k_proj(h') * key_multiplier, v = v_proj(h')          h' = h * attention_in_multiplier
    rotary over the whole head_dim (rope_theta; only rope_type "default"), causal, scale head_dim^-0.5,
    num_key_value_heads groups; a = o_proj(attn). head_dim defaults to hidden_size / num_attention_heads but
    real checkpoints set it (Falcon-H1-0.5B: hidden 1024, 8 heads, head_dim 64).

Checkpoint tensors (names of `FalconH1ForCausalLM`, i = layer index):

    model.embed_tokens.weight                     [vocab, hidden]
    lm_head.weight                                [vocab, hidden]   absent or ignored when tie_word_embeddings
    model.final_layernorm.weight                  [hidden]
    model.layers.i.input_layernorm.weight         [hidden]
    model.layers.i.pre_ff_layernorm.weight        [hidden]
    model.layers.i.self_attn.q_proj.weight        [heads * head_dim, hidden]    (.bias iff attention_bias)
    model.layers.i.self_attn.k_proj.weight        [kv_heads * head_dim, hidden]
    model.layers.i.self_attn.v_proj.weight        [kv_heads * head_dim, hidden]
    model.layers.i.self_attn.o_proj.weight        [hidden, heads * head_dim]
    model.layers.i.mamba.in_proj.weight           [inner + conv + n_heads, hidden]  (.bias iff mamba_proj_bias)
    model.layers.i.mamba.conv1d.weight            [conv, 1, d_conv]                 (.bias iff mamba_conv_bias)
    model.layers.i.mamba.dt_bias, A_log, D        [n_heads]
    model.layers.i.mamba.norm.weight              [inner]                           (iff mamba_rms_norm)
    model.layers.i.mamba.out_proj.weight          [hidden, inner]                   (.bias iff projectors_bias)
    model.layers.i.feed_forward.gate_proj.weight  [intermediate, hidden]            (.bias iff mlp_bias)
    model.layers.i.feed_forward.up_proj.weight    [intermediate, hidden]
    model.layers.i.feed_forward.down_proj.weight  [hidden, intermediate]
    `mup_vector` is derived from ssm_multipliers and never stored (a non-persistent buffer in transformers).
    Note: projectors_bias governs the Mamba out_proj only; the attention biases follow attention_bias.

config.json keys (`KEYS` below; anything else is refused, naming the key):

    read          the sizes, rope_theta / rope_parameters / rope_scaling (default rope only), attention_bias,
                  every mamba_* key above, time_step_limit, projectors_bias, the eight multipliers,
                  tie_word_embeddings, max_position_embeddings, bos / eos / pad token ids
    one value     hidden_act=silu, mlp_bias=false, mamba_use_mlp=true (every layer has its MLP),
                  attn_layer_indices=null (attention in every layer), quantization_config=null
    no effect     initialisation (initializer_range, time_step_min / max / floor / rank), attention_dropout,
                  use_cache, num_logits_to_keep, mlp_expansion_factor (intermediate_size shapes the MLP),
                  bookkeeping (model_type, architectures, transformers_version, torch_dtype, dtype, _name_or_path)

cairn's classes: FalconH1Mixer (the parallel pair with its four multipliers) holds a KeyScaledAttention
(plain attention, keys scaled before rotary, so the KV pool holds what transformers' cache holds) and
a Mamba2Mixer; ScaledSwiGLU is the MLP with its two multipliers; the norms are plain RMSNorms
(weight * x / rms(x), not Qwen's zero-centred ones). Snapshots hold every layer's conv and SSM state,
KV pages every layer's keys and values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cairn.forward_batch import ForwardBatch
from cairn.layers.attention import Attention, paged_attention
from cairn.layers.mamba2 import Mamba2Mixer
from cairn.layers.mlp import SwiGLU
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.model.config import (
    ConfigError,
    KeyTable,
    Mamba2Shape,
    ModelConfig,
    config_floats,
    default_rope_theta,
    dt_limit,
    eos_ids,
)
from cairn.model.hybrid import HybridModel, ParallelAttentionMamba2, Target, swiglu_targets
from cairn.ops import Kernels

MODEL_TYPES = ("falcon_h1",)

KEYS = KeyTable(
    read=frozenset({
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "rope_theta", "rope_parameters", "rope_scaling", "attention_bias", "mamba_d_ssm", "mamba_n_heads",
        "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_chunk_size",
        "mamba_conv_bias", "mamba_proj_bias", "mamba_rms_norm", "mamba_norm_before_gate", "time_step_limit",
        "projectors_bias", "embedding_multiplier", "lm_head_multiplier", "key_multiplier",
        "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
        "ssm_multipliers", "mlp_multipliers", "bos_token_id", "eos_token_id", "pad_token_id",
    }),
    required={
        "hidden_act": ("silu",),
        "mlp_bias": (False,),
        "mamba_use_mlp": (True,),
        "attn_layer_indices": (None,),
        "quantization_config": (None,),
    },
    # training knobs (initialisation, dropout), bookkeeping, and the logits transformers keeps
    no_effect=frozenset({
        "initializer_range", "use_cache", "num_logits_to_keep", "attention_dropout", "mlp_expansion_factor",
        "time_step_min", "time_step_max", "time_step_floor", "time_step_rank", "model_type", "architectures",
        "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    }),
)


@dataclass(frozen=True)
class FalconH1Config(ModelConfig):
    """ModelConfig plus the multipliers Falcon-H1 applies inside its layers (1.0: none)."""

    key_multiplier: float = 1.0  # keys are scaled by it before rotary and the KV pool
    attention_in_multiplier: float = 1.0  # the attention's input (the normed hidden state) is scaled by it
    attention_out_multiplier: float = 1.0  # the attention's output is scaled by it
    ssm_out_multiplier: float = 1.0  # the Mamba2 mixer's output is scaled by it
    mlp_gate_multiplier: float = 1.0  # mlp_multipliers[0]: the gate projection is scaled by it before silu
    mlp_down_multiplier: float = 1.0  # mlp_multipliers[1]: the MLP's output is scaled by it


def parse_config(raw: dict[str, Any]) -> FalconH1Config:
    KEYS.check(raw)
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    n = int(raw["num_hidden_layers"])
    gate_mult, down_mult = config_floats(raw.get("mlp_multipliers") or (1.0, 1.0), "mlp_multipliers", 2)
    cfg = FalconH1Config(
        family="falcon_h1", vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        layer_types=("attention+mamba2",) * n, ffn_types=("dense",) * n,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), tie_word_embeddings=bool(raw.get("tie_word_embeddings")),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        num_attention_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
        rope_theta=default_rope_theta(raw), rotary_dim=head_dim, attention_gated=False,
        attention_bias=bool(raw.get("attention_bias", False)), mamba=_mamba_shape(raw, hidden),
        intermediate_size=int(raw["intermediate_size"]), zero_centred_norms=False,
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        logits_multiplier=float(raw.get("lm_head_multiplier", 1.0)), eos_token_ids=eos_ids(raw),
        key_multiplier=float(raw.get("key_multiplier", 1.0)),
        attention_in_multiplier=float(raw.get("attention_in_multiplier", 1.0)),
        attention_out_multiplier=float(raw.get("attention_out_multiplier", 1.0)),
        ssm_out_multiplier=float(raw.get("ssm_out_multiplier", 1.0)),
        mlp_gate_multiplier=gate_mult, mlp_down_multiplier=down_mult)
    cfg.validate()
    return cfg


def _mamba_shape(raw: dict[str, Any], hidden: int) -> Mamba2Shape:
    """The mixer's widths as transformers derives them (see the module docstring), and its options."""
    inner = raw.get("mamba_d_ssm", 1024)
    inner = int(inner if inner is not None else int(raw.get("mamba_expand", 2)) * hidden)
    num_heads = int(raw.get("mamba_n_heads", 128))
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = inner // num_heads if head_dim in ("auto", None) else int(head_dim)
    if head_dim * num_heads != inner:
        raise ConfigError(f"config.json: mamba_n_heads={num_heads} * mamba_d_head={head_dim} != mamba_d_ssm={inner}")
    return Mamba2Shape(
        num_heads=num_heads, head_dim=head_dim, n_groups=int(raw.get("mamba_n_groups", 1)),
        state_size=int(raw.get("mamba_d_state", 256)), conv_kernel=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("mamba_chunk_size", 256)), norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        dt_limit=dt_limit(raw.get("time_step_limit")),
        conv_bias=bool(raw.get("mamba_conv_bias", True)), in_proj_bias=bool(raw.get("mamba_proj_bias", False)),
        out_proj_bias=bool(raw.get("projectors_bias", False)), gated_norm=bool(raw.get("mamba_rms_norm", False)),
        norm_before_gate=bool(raw.get("mamba_norm_before_gate", True)),
        input_multiplier=float(raw.get("ssm_in_multiplier", 1.0)),
        zxbcdt_multipliers=config_floats(raw.get("ssm_multipliers") or (1.0,) * 5, "ssm_multipliers", 5))


class KeyScaledAttention(Attention):
    """Plain attention whose keys are scaled by `key_multiplier` before rotary (what the KV pool holds)."""

    def __init__(self, *args, key_multiplier: float):
        super().__init__(*args)
        self.key_multiplier = key_multiplier

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv: KVPool, kernels: Kernels) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim) * self.key_multiplier
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary.apply(q, *cos_sin), self.rotary.apply(k, *cos_sin)
        out = paged_attention(q, k, v, batch, kv, self.pool_index, kernels, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class FalconH1Mixer(ParallelAttentionMamba2):
    """mamba(h) * ssm_out_multiplier + attention(h * attention_in_multiplier) * attention_out_multiplier."""

    def __init__(self, attention: nn.Module, mamba: nn.Module, cfg: FalconH1Config):
        super().__init__(attention, mamba)
        self.attention_in, self.attention_out = cfg.attention_in_multiplier, cfg.attention_out_multiplier
        self.ssm_out = cfg.ssm_out_multiplier

    def forward(self, h, batch: ForwardBatch, cos_sin, kv: KVPool, states: StatePool, kernels: Kernels):
        m = self.mamba(h, batch, states, kernels) * self.ssm_out
        a = self.attention(h * self.attention_in, batch, cos_sin, kv, kernels) * self.attention_out
        return m + a


class ScaledSwiGLU(SwiGLU):
    """down(silu(gate(x) * gate_multiplier) * up(x)) * down_multiplier."""

    def __init__(self, hidden: int, inner: int, gate_multiplier: float, down_multiplier: float):
        super().__init__(hidden, inner)
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate * self.gate_multiplier) * up) * self.down_multiplier


# checkpoint name (relative to model.layers.i.) -> cairn parameter (relative to layers.i.)
_LAYER_NAMES = {"input_layernorm.weight": "input_norm.weight", "pre_ff_layernorm.weight": "post_norm.weight"}


class FalconH1ForCausalLM(HybridModel):
    """Parallel attention + Mamba2 in every layer, with Falcon-H1's multipliers; tensor names as in the
    module docstring (`self_attn.*` -> mixer.attention, `mamba.*` -> mixer.mamba, `feed_forward.*` -> mlp)."""

    cfg: FalconH1Config

    def make_mixer(self, layer: int) -> nn.Module:
        cfg = self.cfg
        attention = KeyScaledAttention(cfg.attention_spec(), self._attention_index[layer], self.rotary,
                                       key_multiplier=cfg.key_multiplier)
        return FalconH1Mixer(attention, Mamba2Mixer(cfg.mamba2_spec(), layer), cfg)

    def make_mlp(self, layer: int) -> nn.Module:
        cfg = self.cfg
        return ScaledSwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier)

    def targets(self, name: str) -> list[Target] | None:
        if name == "model.final_layernorm.weight":
            return [Target("norm.weight")]
        return None if name == "model.norm.weight" else super().targets(name)

    def layer_targets(self, layer: int, rest: str) -> list[Target] | None:
        if rest in _LAYER_NAMES:
            return [Target(_LAYER_NAMES[rest])]
        if rest.startswith("feed_forward."):
            return swiglu_targets(rest[len("feed_forward."):], "mlp.", self.cfg.intermediate_size)
        m = re.fullmatch(r"(self_attn|mamba)\.(.+)", rest)
        if m:  # attention and Mamba2 parameters carry the checkpoint's own names
            param = ("mixer.attention." if m.group(1) == "self_attn" else "mixer.mamba.") + m.group(2)
            return [Target(param)] if self.has_parameter(f"layers.{layer}.{param}") else None
        return None




MODEL_CLASS = FalconH1ForCausalLM
