"""ModelConfig: the architecture of a hybrid checkpoint, parsed once from its Hugging Face config.json.

Model code never reads a raw HF config. Each family file (`cairn/model/<family>.py`) parses its own
config.json into one frozen ModelConfig (or a subclass adding the family's own fields), with a
`KeyTable` that sorts every key: read (it shapes the model), required to hold one value (e.g.
`hidden_act` must be `silu`), known to have no effect on inference (training-only or multimodal), or
refused with a reason; an unknown key is an error naming it. `cairn.model.families` picks the family
file by `model_type`.

One ModelConfig describes every family as a stack of layers, each with a token mixer and a
feed-forward part, either of which may be absent:

    layer_types[i]  "linear_attention" (Gated DeltaNet) | "full_attention" | "mamba2"
                    | "attention+mamba2" (both in parallel on the same input, Falcon-H1) | "none"
    ffn_types[i]    "dense" | "moe" | "none"

    Qwen3.5:    linear_attention/dense  linear_attention/dense  linear_attention/dense  full_attention/dense
    Nemotron-H: mamba2/none  none/dense  mamba2/none  full_attention/none  none/moe   (M - M * E)

The config also hands each layer its own small spec (`attention_spec`, `gated_deltanet_spec`,
`mamba2_spec`), so that layers never read a ModelConfig, and describes the recurrent state as named
per-layer tensors (`state_spec`), from which the state pools, snapshot tiers and disk segments are laid
out. This module is torch-free (preflight parses configs before torch is imported) and never touches
weights.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from cairn.layers.attention import AttentionSpec
    from cairn.layers.gated_deltanet import GatedDeltaNetSpec
    from cairn.layers.mamba2 import Mamba2Spec
    from cairn.memory.state_spec import StateSpec

log = logging.getLogger(__name__)

MIXERS = ("linear_attention", "full_attention", "mamba2", "attention+mamba2", "none")
FFNS = ("dense", "moe", "none")
_ATTENTION = ("full_attention", "attention+mamba2")
_MAMBA = ("mamba2", "attention+mamba2")


class ConfigError(ValueError):
    """A checkpoint's config asks for something cairn does not implement."""


class WeightError(ValueError):
    """A checkpoint's tensors do not fit the model (missing, unexpected or misshapen). Here, torch-free, so that
    the command line can print it as one line without importing the model."""


@dataclass(frozen=True)
class KeyTable:
    """How a family treats each key of its config.json (see the module docstring)."""

    read: frozenset[str]  # shape the model; the family's parser reads them
    required: dict[str, tuple[Any, ...]]  # implemented for these values only
    no_effect: frozenset[str]  # training knobs, bookkeeping, heads cairn skips
    refused: dict[str, str] = field(default_factory=dict)  # key -> why it is refused (when set and not None)

    def check(self, text: dict[str, Any]) -> None:
        """Raise ConfigError naming the first key that is unknown, refused, or holds an unsupported value."""
        for key, value in text.items():
            if key in self.read or key in self.no_effect:
                continue
            if key in self.required:
                if value not in self.required[key]:
                    raise ConfigError(f"config.json: {key}={value!r} is not implemented by cairn "
                                      f"(supported: {self.required[key]})")
                continue
            if key in self.refused:
                if value is None or value is False or value == 0:
                    continue
                raise ConfigError(f"config.json: {key}={value!r} is not implemented by cairn ({self.refused[key]})")
            raise ConfigError(f"config.json: key {key!r} is not implemented by cairn")


@dataclass(frozen=True)
class Mamba2Shape:
    """The shape and options of a model's Mamba2 mixers: cairn.layers.mamba2.Mamba2Spec less the model width
    (torch-free twin; see Mamba2Spec for each field's meaning)."""

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    norm_eps: float = 1e-5
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    conv_bias: bool = True
    in_proj_bias: bool = False
    out_proj_bias: bool = False
    gated_norm: bool = True
    norm_before_gate: bool = False
    input_multiplier: float = 1.0
    zxbcdt_multipliers: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one hybrid model. Sizes are counts, dims are elements per vector."""

    family: str  # the family file's name; selects the model class
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: its token mixer, one of MIXERS
    ffn_types: tuple[str, ...]  # per layer: its feed-forward part, one of FFNS
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # attention (full_attention and attention+mamba2 layers)
    num_attention_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1
    rope_theta: float = 10000.0
    rotary_dim: int = 0  # leading dims of each head that are rotated (partial rotary); 0: no rotary (NoPE)
    attention_gated: bool = True  # True: Qwen's gated attention (q/k norm, sigmoid output gate); False: plain
    attention_bias: bool = False  # q/k/v/o projections have biases (plain attention only)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # Gated DeltaNet (linear_attention layers)
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    conv_kernel: int = 4
    # Mamba2 (mamba2 and attention+mamba2 layers)
    mamba: Mamba2Shape | None = None
    # feed-forward
    intermediate_size: int = 0  # dense MLP width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # norms and scalar multipliers (1.0: none)
    zero_centred_norms: bool = True  # True: x / rms(x) * (1 + w) (Qwen); False: x / rms(x) * w
    embedding_multiplier: float = 1.0  # the embeddings are scaled by it
    residual_multiplier: float = 1.0  # each mixer and FFN output is scaled by it before the residual add
    logits_multiplier: float = 1.0  # the logits are scaled by it
    # tensor names and tokens
    weight_prefix: str = "model."  # prefix of the text model's tensors in the checkpoint
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """The layers with a Mamba2 mixer (alone or beside attention)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in _MAMBA)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Every layer with a recurrent state (Gated DeltaNet or Mamba2): the layers of `state_spec`."""
        return tuple(sorted(self.linear_layers + self.mamba_layers))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Every layer with attention (alone or beside Mamba2): the layers of the KV pool, in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in _ATTENTION)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return tuple(t == "moe" for t in self.ffn_types)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_k_heads * self.linear_k_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_v_heads * self.linear_v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the Gated DeltaNet depthwise causal conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    # The layer specs are imported where they are built: parsing a config (preflight) must not load torch.

    def attention_spec(self) -> AttentionSpec:
        from cairn.layers.attention import AttentionSpec

        return AttentionSpec(self.hidden_size, self.num_attention_heads, self.num_kv_heads, self.head_dim,
                             self.rms_norm_eps, bias=self.attention_bias, scale=self.attention_scale)

    def gated_deltanet_spec(self) -> GatedDeltaNetSpec:
        from cairn.layers.gated_deltanet import GatedDeltaNetSpec

        return GatedDeltaNetSpec(self.hidden_size, self.linear_num_k_heads, self.linear_num_v_heads,
                                 self.linear_k_head_dim, self.linear_v_head_dim, self.conv_kernel, self.rms_norm_eps)

    def mamba2_spec(self) -> Mamba2Spec:
        from cairn.layers.mamba2 import Mamba2Spec

        return Mamba2Spec(self.hidden_size, **dataclasses.asdict(self.mamba))

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        """Every recurrent layer's state per slot, for a model computing in `dtype`."""
        from cairn.memory.state_spec import LayerState, StateSpec

        gdn = self.gated_deltanet_spec().state_entries(dtype) if self.linear_layers else ()
        mamba = self.mamba2_spec().state_entries(dtype) if self.mamba_layers else ()
        return StateSpec(tuple(LayerState(i, gdn if self.layer_types[i] == "linear_attention" else mamba)
                               for i in self.recurrent_layers))

    def validate(self) -> None:
        """Raise ConfigError where the layer kinds and shapes do not fit together (family parsers call it)."""
        if len(self.ffn_types) != len(self.layer_types):
            raise ConfigError(f"config.json: {len(self.ffn_types)} FFN kinds for {len(self.layer_types)} layers")
        for kinds, allowed in ((self.layer_types, MIXERS), (self.ffn_types, FFNS)):
            for kind in kinds:
                if kind not in allowed:
                    raise ConfigError(f"config.json: layer kind {kind!r} is not implemented by cairn")
        if self.attention_layers and (self.num_kv_heads < 1 or self.num_attention_heads % self.num_kv_heads):
            raise ConfigError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError("config.json: partial_rotary_factor gives an odd or oversized rotary dim")
        if self.attention_gated and (self.attention_bias or self.attention_scale is not None):
            raise ConfigError("config.json: gated attention with biases or a scale is not implemented by cairn")
        if self.linear_layers and self.linear_num_v_heads % max(self.linear_num_k_heads, 1):
            raise ConfigError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.mamba_layers and (self.mamba is None or self.mamba.num_heads % self.mamba.n_groups):
            raise ConfigError("config.json: the Mamba2 heads must be a multiple of its groups")
        if not self.recurrent_layers:
            log.warning("model has no recurrent layers: it is not hybrid, snapshots will be empty")


def eos_ids(text: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` (an int, a list or absent) as a tuple."""
    eos = text.get("eos_token_id")
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def config_floats(values: Any, key: str, count: int) -> tuple[float, ...]:
    """A list of `count` numbers; transformers writes an infinity as {"__float__": "Infinity"}."""
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise ConfigError(f"config.json: {key} must be a list of {count} numbers, not {values!r}")
    return tuple(float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v) for v in values)


def dt_limit(value: Any, key: str = "time_step_limit") -> tuple[float, float]:
    """A Mamba2 step-size clamp (low, high) from the config; absent or null is none: (0, inf)."""
    return (0.0, float("inf")) if value is None else config_floats(value, key, 2)


def default_rope_theta(raw: dict[str, Any]) -> float:
    """rope_theta from `rope_parameters` / `rope_scaling` or the flat key, for families whose rotary covers the
    whole head with default rope only: any other rope type or parameter is refused naming it."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config.json: rope_type={rope_type!r} is not implemented by cairn (only 'default')")
    for key in params:
        if key not in ("rope_type", "type", "rope_theta"):
            raise ConfigError(f"config.json: rope_parameters.{key} is not implemented by cairn")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
