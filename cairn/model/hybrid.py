"""HybridModel: the decoder stack shared by every family (Qwen3.5 / Qwen3-Next, Nemotron-H, ...).

    embed * embedding_multiplier
      -> [ x + r * mixer(norm(x)) ; x + r * ffn(norm(x)) ] * num_layers      (r: residual_multiplier;
                                                                              each add runs with the norm after it)
      -> norm -> lm_head * logits_multiplier

where each layer's mixer is Gated DeltaNet, full attention (Qwen's gated one or plain), Mamba2,
attention and Mamba2 in parallel, or absent, and its FFN is a dense MLP, a sparse MoE, or absent
(`cfg.layer_types`, `cfg.ffn_types`; a layer with only one of the two has only its norm). A family
file subclasses this with its choice of modules (`make_mixer`, `make_mlp`, `make_norm`) and the map
from its checkpoint's tensor names to these parameters (`targets`, `layer_targets`).

Checkpoint tensors are copied straight into slices of the (possibly fused) parameters as they stream
in; `finish_loading` then checks that every element of every parameter was written exactly once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from cairn.forward_batch import ForwardBatch
from cairn.layers.attention import Attention, GatedAttention
from cairn.layers.gated_deltanet import GatedDeltaNet
from cairn.layers.mamba2 import Mamba2Mixer
from cairn.layers.mlp import SparseMoE, SwiGLU
from cairn.layers.norm import PlainRMSNorm, RMSNorm
from cairn.layers.recurrent import RecurrentMixer
from cairn.layers.rotary import PartialRotary
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.model import decode_plan
from cairn.model.config import ModelConfig, WeightError
from cairn.ops import REFERENCE, Kernels


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, the region of it, and a transform applied first."""

    param: str
    region: tuple = ()  # index into the parameter (slices / ints); () is the whole parameter
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


class ParallelAttentionMamba2(nn.Module):
    """Attention and a Mamba2 mixer on the same input ("attention+mamba2" layers): the family file that has
    such layers subclasses it with the forward that sums them under its multipliers (Falcon-H1's
    FalconH1Mixer) and builds it in its make_mixer. `mamba.layer` names its state, `attention.pool_index`
    its KV."""

    def __init__(self, attention: nn.Module, mamba: Mamba2Mixer):
        super().__init__()
        self.attention, self.mamba = attention, mamba


class DecoderLayer(nn.Module):
    """x + r * mixer(input_norm(x)), then x + r * mlp(post_norm(x)); a part that is None is skipped with its norm.

    Each residual add runs with the norm after it (`RMSNorm.add_and_norm`, one op on CPU in bf16), so a
    layer takes and returns the stream as (x, pending): the stream is x + pending, pending being the last
    update not yet added (None: nothing pending). The next layer's first norm, or the model's final
    norm, adds it."""

    def __init__(self, mixer: nn.Module | None, mlp: nn.Module | None, make_norm: Callable[[], nn.Module],
                 residual_multiplier: float = 1.0):
        super().__init__()
        self.input_norm = make_norm() if mixer is not None else None
        self.mixer = mixer
        self.post_norm = make_norm() if mlp is not None else None
        self.mlp = mlp
        self.mlp_takes_kernels = getattr(mlp, "takes_kernels", False)  # SwiGLU: its activation is a Kernels field
        self.residual_multiplier = residual_multiplier
        self.mixer_kind = ("recurrent" if isinstance(mixer, RecurrentMixer)
                           else "parallel" if isinstance(mixer, ParallelAttentionMamba2) else "attention")

    def forward(self, x, pending, batch, cos_sin, kv: KVPool, states: StatePool, kernels: Kernels):
        if self.mixer is not None:
            x, h = self.input_norm.add_and_norm(x, pending, kernels)
            pending = self._scaled(self.mix(h, batch, cos_sin, kv, states, kernels))
        if self.mlp is not None:
            x, h = self.post_norm.add_and_norm(x, pending, kernels)
            pending = self._scaled(self.feed(h, kernels))
        return x, pending

    def mix(self, h, batch, cos_sin, kv: KVPool, states: StatePool, kernels: Kernels) -> torch.Tensor:
        """The mixer on the normed rows h, with what its kind takes."""
        if self.mixer_kind == "recurrent":
            return self.mixer(h, batch, states, kernels)
        if self.mixer_kind == "parallel":
            return self.mixer(h, batch, cos_sin, kv, states, kernels)
        return self.mixer(h, batch, cos_sin, kv, kernels)

    def feed(self, h: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """The FFN on the normed rows h."""
        return self.mlp(h, kernels) if self.mlp_takes_kernels else self.mlp(h)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels = REFERENCE):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.rotary = PartialRotary(cfg.rotary_dim, cfg.rope_theta) if cfg.rotary_dim else None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self._attention_index = {layer: i for i, layer in enumerate(cfg.attention_layers)}
        self.layers = nn.ModuleList([
            DecoderLayer(self.make_mixer(i), self.make_mlp(i), lambda: self.make_norm(cfg.hidden_size),
                         cfg.residual_multiplier)
            for i in range(cfg.num_layers)])
        self.norm = self.make_norm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self._written: dict[str, int] = {}
        self.plan_decode = True  # pure decode steps through a DecodePlan where it binds (cairn/model/decode_plan.py)
        self._plan: decode_plan.DecodePlan | None = None
        self._plan_kernels: Kernels | None = None  # the Kernels _plan was built for (rebuilt when they change)

    def make_norm(self, dim: int) -> nn.Module:
        eps = self.cfg.rms_norm_eps
        return RMSNorm(dim, eps) if self.cfg.zero_centred_norms else PlainRMSNorm(dim, eps)

    def make_mixer(self, layer: int) -> nn.Module | None:
        kind = self.cfg.layer_types[layer]
        if kind == "linear_attention":
            return GatedDeltaNet(self.cfg.gated_deltanet_spec(), layer)
        if kind == "full_attention":
            return self.make_attention(layer)
        if kind == "mamba2":
            return Mamba2Mixer(self.cfg.mamba2_spec(), layer)
        return None  # "none"; the family with "attention+mamba2" layers builds them (ParallelAttentionMamba2)

    def make_attention(self, layer: int) -> nn.Module:
        spec, index = self.cfg.attention_spec(), self._attention_index[layer]
        if self.cfg.attention_gated:
            return GatedAttention(spec, index, self.rotary)
        return Attention(spec, index, self.rotary)

    def make_mlp(self, layer: int) -> nn.Module | None:
        """The Qwen families' FFN: every layer has one (the families with FFN-less layers override this)."""
        cfg = self.cfg
        if cfg.ffn_types[layer] == "moe":
            return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                             cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, states: StatePool) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(batch.logits_indices), vocab] and updates kv / states."""
        cfg = self.cfg
        x = self.embed(batch.input_ids)
        if cfg.embedding_multiplier != 1.0:
            x = x * cfg.embedding_multiplier
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype) if self.rotary is not None else None
        pending = None  # the stream is x + pending (DecoderLayer)
        plan = self.decode_plan() if self.plan_decode else None
        layers = plan.layers if plan is not None and plan.takes(x.shape[0], batch.num_decode) \
            else self.layers
        for layer in layers:
            x, pending = layer(x, pending, batch, cos_sin, kv, states, self.kernels)
        rows = batch.logits_indices  # only these rows' stream is needed from here on
        _, h = self.norm.add_and_norm(x[rows], None if pending is None else pending[rows], self.kernels)
        logits = self.lm_head(h).float()
        return logits if cfg.logits_multiplier == 1.0 else logits * cfg.logits_multiplier

    def attention_break_even(self) -> int:
        """The position at which a prefill token's attention work (its query against every earlier key and
        value, in every attention layer) equals the work of its layers' weights: a chunk of n tokens at
        position p costs about n * (1 + p / this) of a chunk at position 0. Counted in multiply-adds from the
        weights (routed experts: the share each token uses); 0 without attention layers."""
        cfg = self.cfg
        per_position = 2 * cfg.num_attention_heads * cfg.head_dim * len(cfg.attention_layers)  # q.k and p.v
        if not per_position:
            return 0
        per_token = 0
        for p in [*self.layers.parameters(), *self.layers.buffers()]:  # (a layout's or int8 weights are buffers)
            routed = cfg.num_experts and p.dim() == 3 and p.shape[0] == cfg.num_experts  # stacked experts
            expert_share = cfg.num_experts_per_tok / cfg.num_experts if routed else 1.0
            per_token += int(p.numel() * expert_share)
        return max(1, per_token // per_position)

    def decode_plan(self) -> decode_plan.DecodePlan | None:
        """The layers' DecodePlan for the current Kernels (built on first use, once the weights are laid out), or
        None where it would bind nothing."""
        if self._plan_kernels is not self.kernels:
            self._plan, self._plan_kernels = decode_plan.build(self), self.kernels
        return self._plan

    # ---- checkpoint loading -------------------------------------------------------------------------

    def targets(self, name: str) -> list[Target] | None:
        """Where checkpoint tensor `name` goes, or None when the family does not know it."""
        cfg = self.cfg
        p = cfg.weight_prefix
        if name == p + "embed_tokens.weight":
            return [Target("embed.weight")]
        if name == p + "norm.weight":
            return [Target("norm.weight")]
        if name == "lm_head.weight":
            return [] if cfg.tie_word_embeddings else [Target("lm_head.weight")]
        m = re.fullmatch(re.escape(p) + r"layers\.(\d+)\.(.+)", name)
        if not m or int(m.group(1)) >= cfg.num_layers:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        found = self.layer_targets(layer, rest)
        return None if found is None else [Target(f"layers.{layer}." + t.param, t.region, t.transform) for t in found]

    def layer_targets(self, layer: int, rest: str) -> list[Target] | None:
        """Where tensor `rest` of layer `layer` goes (parameter names relative to the layer)."""
        return (self.norm_targets(rest) or self.attention_targets(rest)
                or self.linear_targets(rest) or self.mlp_targets(layer, rest))

    def has_parameter(self, name: str) -> bool:
        """False for a tensor the config says the model does not have (an absent bias: it then has no place)."""
        try:
            self.get_parameter(name)
        except AttributeError:
            return False
        return True

    @staticmethod
    def norm_targets(rest: str) -> list[Target] | None:
        names = {"input_layernorm.weight": "input_norm.weight", "post_attention_layernorm.weight": "post_norm.weight"}
        return [Target(names[rest])] if rest in names else None

    @staticmethod
    def attention_targets(rest: str) -> list[Target] | None:
        m = re.fullmatch(r"self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight", rest)
        return [Target(f"mixer.{m.group(1)}.weight")] if m else None

    def linear_targets(self, rest: str) -> list[Target] | None:
        """Gated DeltaNet tensors in the Qwen3.5 layout (separate in_proj_qkv / _z / _b / _a)."""
        cfg = self.cfg
        if not rest.startswith("linear_attn."):
            return None
        rest = rest[len("linear_attn."):]
        c, vd, vh = cfg.conv_dim, cfg.linear_value_dim, cfg.linear_num_v_heads
        rows = {"in_proj_qkv.weight": slice(0, c), "in_proj_z.weight": slice(c, c + vd),
                "in_proj_b.weight": slice(c + vd, c + vd + vh), "in_proj_a.weight": slice(c + vd + vh, c + vd + 2 * vh)}
        if rest in rows:
            return [Target("mixer.in_proj.weight", (rows[rest],))]
        plain = {"dt_bias": "mixer.dt_bias", "A_log": "mixer.A_log", "norm.weight": "mixer.norm.weight",
                 "out_proj.weight": "mixer.out_proj.weight"}
        if rest in plain:
            return [Target(plain[rest])]
        if rest == "conv1d.weight":
            return [Target("mixer.conv_weight", (), lambda t: t.reshape(t.shape[0], -1))]
        return None

    def mlp_targets(self, layer: int, rest: str) -> list[Target] | None:
        if not rest.startswith("mlp."):
            return None
        rest = rest[len("mlp."):]
        if self.cfg.ffn_types[layer] != "moe":
            return swiglu_targets(rest, "mlp.", self.cfg.intermediate_size)
        inner = self.cfg.moe_intermediate_size
        if rest == "gate.weight":
            return [Target("mlp.router.weight")]
        if rest == "shared_expert_gate.weight":
            return [Target("mlp.shared_gate.weight")]
        if rest.startswith("shared_expert."):
            return swiglu_targets(rest[len("shared_expert."):], "mlp.shared.", self.cfg.shared_expert_intermediate_size)
        m = re.fullmatch(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if m:
            e, which = int(m.group(1)), m.group(2)
            if which == "down_proj":
                return [Target("mlp.down", (e,))]
            rows = slice(0, inner) if which == "gate_proj" else slice(inner, 2 * inner)
            return [Target("mlp.gate_up", (e, rows))]
        fused = {"experts.gate_up_proj": "mlp.gate_up", "experts.down_proj": "mlp.down"}
        return [Target(fused[rest])] if rest in fused else None

    def load_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor into place; False when the name belongs to no parameter."""
        targets = self.targets(name)
        params = dict(self.named_parameters(remove_duplicate=False))
        # the name maps by its form alone: a layer of another kind than the tensor's lacks the parameter
        if targets is None or any(t.param not in params for t in targets):
            return False
        for t in targets:
            value = t.transform(tensor) if t.transform else tensor
            dest = params[t.param].data[t.region] if t.region else params[t.param].data
            if tuple(dest.shape) != tuple(value.shape):
                raise WeightError(f"{name}: shape {tuple(value.shape)} does not fit {t.param}{list(t.region)} "
                                  f"of shape {tuple(dest.shape)}")
            dest.copy_(value)
            self._written[t.param] = self._written.get(t.param, 0) + value.numel()
        return True

    def finish_loading(self) -> None:
        """Raise WeightError unless every parameter was written exactly once, element for element."""
        problems = []
        for name, param in self.named_parameters():
            written = self._written.get(name, 0)
            if written != param.numel():
                problems.append(f"{name} ({written} of {param.numel()} elements)")
        self._written = {}
        if problems:
            raise WeightError(f"checkpoint leaves {len(problems)} parameter(s) incomplete: {', '.join(problems[:8])}")


def swiglu_targets(rest: str, module: str, inner: int) -> list[Target] | None:
    rows = {"gate_proj.weight": slice(0, inner), "up_proj.weight": slice(inner, 2 * inner)}
    if rest in rows:
        return [Target(module + "gate_up.weight", (rows[rest],))]
    if rest == "down_proj.weight":
        return [Target(module + "down.weight")]
    return None
