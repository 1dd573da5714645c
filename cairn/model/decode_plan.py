"""DecodePlan: a pure decode step's layers as pre-bound calls into cairn's fused CPU ops (bf16 on CPU).

A decode step of the 0.8B model makes ~210 calls into cairn's C++ ops (109 linears, 49 norms, 24 activations, 18
GDN ops, 6 attention-input and 6 attention ops), each of which the module path reaches through
nn.Module.__call__, attribute lookups (~1 us each), a Kernels field and the op's dispatcher checking dtype,
device and layout again. The tensors a call needs besides its input (weights, eps, the op's build) are fixed
once the model is loaded, so a plan binds them once, per layer, and a step then calls the ops directly:

    layer i:  x, h = norm_i(x, pending)                  cpu_norm.bound_add_rms_norm (the residual add too)
              x, h = post_norm_i(x, mixer_i(h, ...))     GDN: in_proj -> GatedDeltaNet.fused_decode -> out_proj;
                                                         GatedAttention.attend with its linears bound
              pending = down_i(silu(gate_up_i(h)))       SwiGLU: its linears' decode_call (the gemv kernel, or int8's),
                                                         cpu_silu.bound_silu_mul

Measured (docs/kernels.md, the decode plan) on the 0.8B's 24 layers at tiny widths, where only the calls
cost: a batch-1 step in half the time. The ops, their arguments and their order are the module path's, so
are the bits (a test holds greedy tokens and log-probabilities equal to it, batched and alone).

A plan binds only what the module path would run the same way: a norm whose Kernels field is not the fused default,
or whose op does not load, leaves its layer called whole; a GDN layer whose fused op is not taken, or an FFN other
than SwiGLU with the fused activation, stays a call of its module; a layer of another form (no mixer or no FFN, a
residual multiplier) is called whole. The model takes the plan only for a pure decode batch of at most `max_rows`
sequences (its linears' direct rows: 16 on the gemv kernel's paths, 4 in int8 off the AVX2 path) and rebuilds it
when its Kernels change;
`HybridModel.plan_decode = False` keeps every step on the modules (benchmarks/decode_profile.py's breakdown, which
instruments them). A build logs one line: how many layers it binds, for up to how many rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from cairn import ops
from cairn.layers.attention import GatedAttention
from cairn.layers.gated_deltanet import GatedDeltaNet
from cairn.layers.mlp import SwiGLU
from cairn.layers.norm import RMSNorm
from cairn.model.layout import GemvLinear, Int8Linear
from cairn.ops import Kernels, cpu_gdn, cpu_norm, cpu_silu

log = logging.getLogger(__name__)


class DecodePlan:
    """The per-layer calls of a pure decode step (`layers`, each called like DecoderLayer), for the Kernels they
    were bound with; `max_rows`: the most decode rows they take."""

    def __init__(self, layers: list[Callable], max_rows: float):
        self.layers, self.max_rows = layers, max_rows

    def takes(self, rows: int, num_decode: int) -> bool:
        """Whether a step of `rows` tokens, `num_decode` of them decode rows, runs this plan."""
        return num_decode == rows <= self.max_rows


def build(model: nn.Module) -> DecodePlan | None:
    """The plan of `model`'s decoder layers on its Kernels, or None: a model not in bf16 on CPU (the fused ops'
    domain), or one whose every layer would be called whole."""
    weight = model.embed.weight
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    bound = Binder(model.kernels)
    calls = [bound.layer(layer) for layer in model.layers]
    planned = sum(call is not layer for call, layer in zip(calls, model.layers, strict=True))
    if not planned:
        return None
    rows = "any number of" if bound.max_rows == math.inf else f"up to {bound.max_rows}"
    log.info("decode plan: %d of %d layers through pre-bound calls, for pure decode batches of %s rows", planned,
             len(calls), rows)
    return DecodePlan(calls, bound.max_rows)


class Binder:
    """Binds one model's modules for `kernels`; `max_rows`: the fewest direct rows of a linear bound so far."""

    def __init__(self, kernels: Kernels):
        self.kernels, self.max_rows = kernels, math.inf

    def layer(self, layer: nn.Module) -> Callable:
        """A DecoderLayer's decode call, or the layer itself where the plan does not know its form."""
        if layer.mixer is None or layer.mlp is None or layer.residual_multiplier != 1.0:
            return layer
        first, second = self.norm(layer.input_norm), self.norm(layer.post_norm)
        if first is None or second is None:
            return layer
        mixer, mlp = self.mixer(layer), self.mlp(layer)

        def call(x, pending, batch, cos_sin, kv, states, kernels):
            x, h = first(x, pending)
            x, h = second(x, mixer(h, batch, cos_sin, kv, states))
            return x, mlp(h)
        return call

    def norm(self, norm: nn.Module) -> Callable | None:
        """(x, delta | None) -> (x + delta, normed), add_and_norm bound; None where not the fused op."""
        fused = self.kernels.add_rms_norm is ops.fused_add_rms_norm
        if type(norm).add_and_norm is not RMSNorm.add_and_norm or not fused:
            return None
        return cpu_norm.bound_add_rms_norm(norm.weight, norm.eps, norm.zero_centred)

    def linear(self, linear: nn.Module) -> Callable:
        """The kernel call of a linear that has one for decode rows (GemvLinear, Int8Linear: `decode_call`, up to
        its `direct_rows`), else the module."""
        if not isinstance(linear, (GemvLinear, Int8Linear)):
            return linear
        self.max_rows = min(self.max_rows, linear.direct_rows)
        return linear.decode_call()

    def mixer(self, layer: nn.Module) -> Callable:
        """(h, batch, cos_sin, kv, states) -> the mixer's output rows: Gated DeltaNet's projections and fused op
        bound, any other mixer called as DecoderLayer calls it."""
        mixer, kernels = layer.mixer, self.kernels
        params, eps = mixer.fused_params() if isinstance(mixer, GatedDeltaNet) else ((), 0.0)
        op = kernels.gdn_decode_op
        fused = cpu_gdn.op_for(*params, op.path) if params and isinstance(op, ops.CpuOp) else None
        if fused is not None:
            in_proj, out_proj, fused_decode = (self.linear(mixer.in_proj), self.linear(mixer.out_proj),
                                               mixer.fused_decode)
            return lambda h, batch, cos_sin, kv, states: out_proj(
                fused_decode(fused, in_proj(h), batch, states, params, eps))
        if type(mixer) is GatedAttention:
            linears = tuple(self.linear(m) for m in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj))
            return lambda h, batch, cos_sin, kv, states: mixer.attend(h, batch, cos_sin, kv, kernels, *linears)
        return lambda h, batch, cos_sin, kv, states: layer.mix(h, batch, cos_sin, kv, states, kernels)

    def mlp(self, layer: nn.Module) -> Callable:
        """h -> the FFN's output rows: SwiGLU's linears and activation bound, any other FFN called as
        DecoderLayer calls it."""
        mlp, kernels = layer.mlp, self.kernels
        silu = cpu_silu.bound_silu_mul(kernels.silu_mul.path) if isinstance(kernels.silu_mul, ops.CpuOp) else None
        if type(mlp) is SwiGLU and silu is not None:
            gate_up, down = self.linear(mlp.gate_up), self.linear(mlp.down)
            return lambda h: down(silu(gate_up(h)))
        return lambda h: layer.feed(h, kernels)
