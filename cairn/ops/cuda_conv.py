"""causal-conv1d (Dao-AILab's `causal_conv1d` package) behind the contracts of cairn/ops/conv.py.

Two kernels of the package are used, with their signatures as published:

    causal_conv1d_fn(x [B, C, T], weight [C, K], bias, seq_idx, initial_states [B, C, K-1],
                     return_final_states, final_states_out, activation) -> out [B, C, T]
    causal_conv1d_update(x [B, C], conv_state [B, C, K-1], weight, bias, activation, ...) -> out [B, C]
                     (conv_state updated where it lies)

Prefill (`causal_conv1d`, `mamba_conv1d`): cairn's segment is token-major [T, C], so `x.t()[None]` is
the channel-last [1, C, T] the package needs when it is given an initial state (its C++ checks: x and
the initial state with channel stride 1, C and x's other strides multiples of 8; a C that is not falls
back to the reference conv for that call); the output comes back in the same layout and `[0].t()` is
token-major again without a copy. The states after `count` tokens
(the captures, and the final state) are the last K-1 inputs before that point: a few rows of the
segment, or of the old state when the segment is shorter than K-1, so they are sliced here rather than
asked of the kernel (which can return the final state only, not mid-segment ones).

Decode (`causal_conv1d_update`, `mamba_conv1d_update`): the package updates the conv state where it
lies. cairn's state has K-1 columns: the releases whose update takes `conv_state_indices` accept any
state_len >= K-1; older builds checked for exactly K columns and refuse it (the GPU check shows which).
The reference returns a new state and leaves its argument alone; both layers write the returned state
back to where the argument came from (a view of the state pool, or a gathered copy they scatter back),
so either behaviour gives the same pool. A state that is not contiguous or not in x's dtype is
copied first and the copy returned.

UNTESTED ON GPU (no GPU was lent when this was written): tests/test_cuda_conv.py checks this module's
reshaping and state logic on CPU with a stand-in of the package's signature; benchmarks/gpu_check.py
compares the real kernels with the references when a GPU and the package are there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cairn.ops import conv
from cairn.ops.optional import import_optional


def state_after(x: torch.Tensor, state: torch.Tensor, count: int) -> torch.Tensor:
    """The conv state [C, K-1] after `count` tokens of the segment x [T, C] that continues `state`: the last
    K-1 inputs before that point (of the segment, preceded by the old state's columns when count < K-1)."""
    keep = state.shape[-1]
    recent = x[max(0, count - keep):count].transpose(0, 1).to(state.dtype)
    if count >= keep:
        return recent.contiguous()
    return torch.cat([state[:, count:], recent], dim=-1)


def make_prefill(conv_fn: Callable) -> Callable:
    """cairn.ops.conv.causal_conv1d's contract (bias optional) on causal_conv1d_fn."""
    def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                      capture_at: Sequence[tuple[int, torch.Tensor]] = (), bias: torch.Tensor | None = None):
        seq_len = x.shape[0]
        conv.check_captures(capture_at, seq_len)
        if x.shape[1] % 8:  # the package's channel-last kernel takes multiples of 8 channels only
            return conv.causal_conv1d(x, state, weight, capture_at, bias=bias)
        initial = state.to(x.dtype).t().contiguous().t()[None]  # [1, C, K-1], channel stride 1
        out = conv_fn(x.contiguous().t()[None], weight.to(x.dtype).contiguous(),
                      bias=None if bias is None else bias.to(x.dtype), initial_states=initial, activation="silu")
        for count, dst in capture_at:
            dst.copy_(state_after(x, state, count))
        return out[0].t(), state_after(x, state, seq_len)

    return causal_conv1d


def make_update(update_fn: Callable) -> Callable:
    """cairn.ops.conv.causal_conv1d_update's contract (bias optional) on causal_conv1d_update, the state
    updated where it lies when it is contiguous and in x's dtype (see the module docstring)."""
    def causal_conv1d_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None):
        work = state if state.is_contiguous() and state.dtype == x.dtype else state.to(x.dtype).contiguous()
        out = update_fn(x.contiguous(), work, weight.to(x.dtype).contiguous(),
                        bias=None if bias is None else bias.to(x.dtype), activation="silu")
        return out, work

    return causal_conv1d_update


def make_mamba_prefill(conv_fn: Callable) -> Callable:
    """cairn.ops.mamba2.mamba_conv1d's contract (bias before capture_at) on causal_conv1d_fn."""
    prefill = make_prefill(conv_fn)

    def mamba_conv1d(x, state, weight, bias, capture_at=()):
        return prefill(x, state, weight, capture_at, bias=bias)

    return mamba_conv1d


def load() -> object | None:
    """The causal_conv1d package, or None when it is absent or fails to import (its CUDA extension is
    built against one torch / CUDA pair; any other raises at import)."""
    return import_optional("causal_conv1d", "causal-conv1d", "reference causal conv")


def kernels() -> dict[str, Callable]:
    """The conv fields of cairn.ops.Kernels that causal-conv1d provides (empty when it does not import)."""
    package = load()
    if package is None:
        return {}
    update = make_update(package.causal_conv1d_update)
    return {"causal_conv1d": make_prefill(package.causal_conv1d_fn), "causal_conv1d_update": update,
            "mamba_conv1d": make_mamba_prefill(package.causal_conv1d_fn), "mamba_conv1d_update": update}
