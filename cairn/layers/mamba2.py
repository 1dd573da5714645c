"""Mamba2: the state-space token mixer of the Nemotron-H, Granite-4.0-H and Falcon-H1 families.

    in_proj(x) -> [ z | x B C | dt ]         one projection: intermediate + conv_dim + heads
    x B C -> causal depthwise conv1d (kernel K, bias, [conv_dim, K-1] streaming state) -> silu
    x -> [heads, head_dim]; B, C -> [n_groups, state_size]; head h reads group h // (heads / n_groups)
    y = SSD scan(x, dt, A = -exp(A_log), B, C, D; state [heads, head_dim, state_size] in fp32)
    out_proj(norm(y, z))     norm: RMSNorm over each group's channels, gated by silu(z)

Parameter names are those of the Hugging Face checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`,
`D`, `norm.weight`, `out_proj`), so a loader copies them unchanged. This module is the mixer alone:
it does not read an HF config (a family file maps one onto `Mamba2Spec`). As a RecurrentMixer it runs a
step's sequences from their slots of the state pool (`forward`); `prefill` and `decode` run the same
computation on states given outside any pool (one sequence's segment; one step for a batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cairn.forward_batch import ForwardBatch
from cairn.layers.recurrent import RecurrentMixer
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import StateTensor
from cairn.ops import Kernels
from cairn.ops.mamba2 import NO_DT_LIMIT


@dataclass(frozen=True)
class Mamba2Spec:
    """The shape and options of one Mamba2 mixer (all families' mixers are this with other values)."""

    hidden_size: int  # model width, the mixer's input and output size
    num_heads: int  # SSM heads
    head_dim: int  # channels per head; intermediate size = num_heads * head_dim
    n_groups: int  # B/C groups, each shared by num_heads / n_groups consecutive heads
    state_size: int  # N, the SSM state per channel
    conv_kernel: int  # K, taps of the causal conv
    chunk_size: int  # tokens per chunk of the SSD scan (the checkpoint's; any value gives the same result)
    norm_eps: float = 1e-5
    dt_limit: tuple[float, float] = NO_DT_LIMIT  # clamp of softplus(dt + dt_bias)
    conv_bias: bool = True
    in_proj_bias: bool = False
    out_proj_bias: bool = False
    gated_norm: bool = True  # False (Falcon-H1 `mamba_rms_norm=False`): y * silu(z), no norm
    norm_before_gate: bool = False  # True: norm(y) * silu(z); False: norm(y * silu(z)) (Nemotron-H, Granite)
    input_multiplier: float = 1.0  # Falcon-H1 `ssm_in_multiplier`: x is scaled before in_proj
    zxbcdt_multipliers: tuple[float, ...] | None = None  # Falcon-H1 `ssm_multipliers`: z, x, B, C, dt scales

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and of its state): x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def ssm_state_shape(self) -> tuple[int, int, int]:
        """Kept in fp32."""
        return (self.num_heads, self.head_dim, self.state_size)

    def state_entries(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        """The conv's last K-1 inputs in the model dtype, the SSM state in fp32."""
        return (StateTensor("conv", self.conv_state_shape(), dtype),
                StateTensor("ssm", self.ssm_state_shape(), torch.float32))


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm over each of `n_groups` equal slices of the channels, gated by silu(gate).

    norm_before_gate=False: weight * rms_norm(x * silu(gate)); True: weight * rms_norm(x) * silu(gate).
    Statistics in fp32; the result in x's dtype.
    """

    def __init__(self, dim: int, n_groups: int, eps: float, norm_before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.n_groups, self.eps, self.norm_before_gate = n_groups, eps, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        xf = x.float()
        if not self.norm_before_gate:
            xf = xf * F.silu(gate.float())
        grouped = xf.view(*shape[:-1], self.n_groups, -1)
        xf = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).view(shape)
        if self.norm_before_gate:
            return (self.weight.float() * xf * F.silu(gate.float())).to(dtype)
        return self.weight * xf.to(dtype)


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, spec: Mamba2Spec, layer: int = 0):
        super().__init__()
        self.spec, self.layer = spec, layer
        inner, conv_dim, heads = spec.intermediate_size, spec.conv_dim, spec.num_heads
        self.in_proj = nn.Linear(spec.hidden_size, inner + conv_dim + heads, bias=spec.in_proj_bias)
        # an nn.Conv1d only to hold `conv1d.weight` [C, 1, K] and `conv1d.bias` [C] as checkpoints name them
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, spec.conv_kernel, groups=conv_dim, bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = (GroupedGatedRMSNorm(inner, spec.n_groups, spec.norm_eps, spec.norm_before_gate)
                     if spec.gated_norm else None)
        self.out_proj = nn.Linear(inner, spec.hidden_size, bias=spec.out_proj_bias)
        # Derived from the config, never loaded: a plain fp32 attribute, not a buffer, because the loader builds
        # the model on the meta device and `to_empty` would leave a buffer uninitialised (see PartialRotary).
        self.zxbcdt_scale = self._zxbcdt_scale(spec) if spec.zxbcdt_multipliers is not None else None

    def state_entries(self, dtype: torch.dtype) -> tuple[StateTensor, ...]:
        return self.spec.state_entries(dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, states: StatePool, kernels: Kernels) -> torch.Tensor:
        z, xbc, dt = self._project(hidden)
        own = states.of_layer(self.layer)
        conv_states, ssm_states = own["conv"], own["ssm"]
        y = hidden.new_empty(hidden.shape[0], self.spec.num_heads, self.spec.head_dim)
        nd = batch.num_decode
        if nd:
            slots = batch.decode_slots()  # a slice (views into the pool, updated in place) when consecutive
            conv, ssm = conv_states[slots], ssm_states[slots]
            y[:nd] = self._step(xbc[:nd], dt[:nd], conv, ssm, kernels)
            if not isinstance(slots, slice):  # gathered copies: write them back
                conv_states[slots], ssm_states[slots] = conv, ssm
        for rows, slot, caps in self.prefill_pieces(batch):
            y[rows], conv_states[slot], ssm_states[slot] = self._scan(
                xbc[rows], dt[rows], conv_states[slot], ssm_states[slot], kernels,
                [(c, dst["conv"], dst["ssm"]) for c, dst in caps])
        return self._output(y, z)

    def _scan(
        self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
        kernels: Kernels, captures: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv and SSD scan of one sequence's segment (after the projection), continuing from the given
        states (not modified): (y [T, heads, head_dim], conv, ssm). captures: (count, conv_out, ssm_out),
        count in [1, T]: the states after that many tokens are written into conv_out and ssm_out."""
        xbc, conv_state = kernels.mamba_conv1d(
            xbc, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias, [(c, dst) for c, dst, _ in captures])
        x, B, C = self._split(xbc)
        y, ssm_state = kernels.ssd_chunk_scan(
            x, dt, self._A(), B, C, self.D, self.dt_bias, ssm_state, self.spec.chunk_size, self.spec.dt_limit,
            [(c, dst) for c, _, dst in captures])
        return y, conv_state, ssm_state

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
              kernels: Kernels) -> torch.Tensor:
        """One decode step of conv and SSM (after the projection), states updated in place: y [B, heads, head_dim]."""
        xbc, new_conv = kernels.mamba_conv1d_update(xbc, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias)
        conv_state.copy_(new_conv)
        x, B, C = self._split(xbc)
        y, _ = kernels.ssd_recurrent_step(x, dt, self._A(), B, C, self.D, self.dt_bias, ssm_state, self.spec.dt_limit)
        return y

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [n, hidden_size] -> z [n, inner], xBC [n, conv_dim], dt [n, heads]."""
        if self.spec.input_multiplier != 1.0:
            hidden = hidden * self.spec.input_multiplier
        projected = self.in_proj(hidden)
        if self.zxbcdt_scale is not None:  # scaled in fp32 (as transformers does), rounded once
            if self.zxbcdt_scale.device != projected.device:
                self.zxbcdt_scale = self.zxbcdt_scale.to(projected.device)
            projected = (projected * self.zxbcdt_scale).to(projected.dtype)
        spec = self.spec
        return projected.split([spec.intermediate_size, spec.conv_dim, spec.num_heads], dim=-1)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xBC [n, conv_dim] -> x [n, heads, head_dim], B and C [n, n_groups, state_size]."""
        spec, n = self.spec, xbc.shape[0]
        groups = spec.n_groups * spec.state_size
        x, B, C = xbc.split([spec.intermediate_size, groups, groups], dim=-1)
        return (x.reshape(n, spec.num_heads, spec.head_dim), B.reshape(n, spec.n_groups, spec.state_size),
                C.reshape(n, spec.n_groups, spec.state_size))

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = y.reshape(y.shape[0], self.spec.intermediate_size)
        y = self.norm(y, z) if self.norm is not None else (y.float() * F.silu(z.float())).to(y.dtype)
        return self.out_proj(y)

    def _A(self) -> torch.Tensor:
        return -self.A_log.float().exp()

    @staticmethod
    def _zxbcdt_scale(spec: Mamba2Spec) -> torch.Tensor:
        """One scale per in_proj output: z, x, B, C and dt each take their multiplier."""
        groups = spec.n_groups * spec.state_size
        sizes = [spec.intermediate_size, spec.intermediate_size, groups, groups, spec.num_heads]
        scales = zip(sizes, spec.zxbcdt_multipliers, strict=True)
        return torch.cat([torch.full((size,), float(m), dtype=torch.float32, device="cpu") for size, m in scales])
