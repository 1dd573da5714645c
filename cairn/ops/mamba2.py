"""Reference (pure PyTorch) kernels of the Mamba2 mixer: its biased causal conv and the SSD scan.

Per head h, with a state S of shape [head_dim, state_size] (fp32) and the head's group g = h // (H/G),
each token t does

    dt_t = clamp(softplus(dt_raw_t + dt_bias), *dt_limit)      (the step size; A = -exp(A_log) < 0)
    S   <- exp(dt_t * A) * S + (dt_t * x_t) B_t^T              (x_t [head_dim], B_t [state_size])
    y_t  = S C_t + D * x_t

`ssd_chunk_scan` computes this for one sequence's prefill segment `chunk_size` tokens at a time with
the state-space-dual (SSD) form: inside a chunk a masked quadratic form (like attention with a decay
mask), across chunks the state is passed once per chunk. `ssd_recurrent_step` takes one step for a
batch of decode sequences. The dt limit is applied in both, so prefill and decode run one recurrence
(transformers and mamba_ssm clamp dt in the chunked scan only; the two agree wherever softplus(dt)
already lies inside the limit).

`mamba_conv1d` is cairn.ops.conv's causal conv with the bias the Mamba2 conv adds before its SiLU
(same state layout [C, K-1], same `capture_at` contract); it goes when conv.py takes a bias.
These are the references a fast kernel must match on outputs and final states; they are fields of
cairn.ops.Kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cairn.ops import conv

NO_DT_LIMIT = (0.0, float("inf"))


def mamba_conv1d(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    capture_at: Sequence[tuple[int, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 conv over x, B and C channels: cairn.ops.conv.causal_conv1d with the layer's bias."""
    return conv.causal_conv1d(x, state, weight, capture_at, bias=bias)


def mamba_conv1d_update(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the Mamba2 conv: cairn.ops.conv.causal_conv1d_update with the layer's bias."""
    return conv.causal_conv1d_update(x, state, weight, bias)


def step_sizes(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """The per-token, per-head step: clamp(softplus(dt + dt_bias), *dt_limit), in fp32."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])


def _expand_groups(b: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N] fp32: head h reads group h // (H / G)."""
    return b.float().repeat_interleave(heads // b.shape[-2], dim=-2)


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal.

    Summed per pair rather than as cumsum[i] - cumsum[j], so the decay between nearby tokens keeps its
    precision when the chunk's total decay is large.
    """
    length = a.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    rows = a.unsqueeze(-1).expand(*a.shape, length)  # rows[..., k, j] = a[k]
    sums = rows.masked_fill(~ones.tril(-1), 0.0).cumsum(-2)  # sum of a[k] over j < k <= i
    return sums.masked_fill(~ones.tril(), float("-inf"))


def _chunked(t: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[T, H, ...] -> [H, n, L, ...], padded with zeros to whole chunks (a zero step: no decay, no input)."""
    t = t.transpose(0, 1)
    pad = (-t.shape[1]) % chunk_size
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)
    return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def ssd_chunk_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    dt_bias: torch.Tensor, initial_state: torch.Tensor, chunk_size: int,
    dt_limit: tuple[float, float] = NO_DT_LIMIT, capture_at: Sequence[tuple[int, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill segment.

    x: [T, H, P]; dt: [T, H] (before softplus); A, D, dt_bias: [H] (A = -exp(A_log)); B, C: [T, G, N];
    initial_state: [H, P, N] fp32 (not modified). capture_at: (count, out) pairs, count in [1, T]: the
    state after that many tokens is written into `out` ([H, P, N] fp32, e.g. a snapshot slot), so a
    snapshot inside the segment needs no split. Returns (y [T, H, P] in x's dtype, final [H, P, N] fp32).

    Chunk i covers tokens [i*L, (i+1)*L); `start_i` is the state before it:
        y[l]      = sum_{s<=l} (C_l . B_s) exp(a_{s+1} + ... + a_l) xdt_s     (inside the chunk)
                  + exp(a_0 + ... + a_l) start_i C_l                          (from earlier chunks)
        start_i+1 = exp(a_0 + ... + a_{L-1}) start_i + sum_s exp(a_{s+1} + ... + a_{L-1}) xdt_s B_s^T
    with a = dt * A (log decay) and xdt = dt * x.
    """
    seq_len, heads, head_dim = x.shape
    groups = B.shape[1]
    wanted = _capture_positions(capture_at, seq_len, chunk_size)
    steps = step_sizes(dt, dt_bias, dt_limit)  # [T, H]
    # heads as [G, R]: the R heads of a group share its B and C, which are not copied per head
    xdt = _chunked(x.float() * steps.unsqueeze(-1), chunk_size).unflatten(0, (groups, -1))  # [G, R, n, L, P]
    a = _chunked(steps * A.float(), chunk_size).unflatten(0, (groups, -1))  # [G, R, n, L]
    Bg, Cg = (_chunked(t.float(), chunk_size).unsqueeze(1) for t in (B, C))  # [G, 1, n, L, N]

    decay = _segment_sums(a).exp()  # [G, R, n, L, L], decay[l, s] from token s to token l
    from_start = a.cumsum(-1).exp()  # [G, R, n, L], decay from the chunk's start through token l
    intra = ((Cg @ Bg.transpose(-1, -2)) * decay) @ xdt  # [G, R, n, L, P]
    chunk_inputs = (xdt * decay[..., -1, :, None]).transpose(-1, -2) @ Bg  # [G, R, n, P, N]

    state = initial_state.float().reshape(groups, -1, head_dim, B.shape[-1])  # a copy is made below
    starts = torch.empty_like(chunk_inputs)
    for i in range(a.shape[2]):
        starts[:, :, i] = state
        for t, dst in wanted.get(i, ()):  # the state after token t of this chunk: its update, cut at t
            weighted = xdt[:, :, i, : t + 1] * decay[:, :, i, t, : t + 1, None]
            inputs = weighted.transpose(-1, -2) @ Bg[:, :, i, : t + 1]
            dst.copy_(torch.addcmul(inputs, state, from_start[:, :, i, t, None, None]).flatten(0, 1))
        state = torch.addcmul(chunk_inputs[:, :, i], state, from_start[:, :, i, -1, None, None])

    inter = (Cg @ starts.transpose(-1, -2)) * from_start.unsqueeze(-1)  # [G, R, n, L, P]
    y = (intra + inter).reshape(heads, -1, head_dim)[:, :seq_len].transpose(0, 1)
    y = y + D.float()[:, None] * x.float()
    return y.to(x.dtype), state.flatten(0, 1)


def _capture_positions(
    capture_at: Sequence[tuple[int, torch.Tensor]], seq_len: int, chunk_size: int
) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """chunk -> [(offset of the capture's last token inside the chunk, out)]."""
    wanted: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for count, dst in capture_at:
        if not 1 <= count <= seq_len:
            raise ValueError(f"capture at {count} is outside the segment's {seq_len} tokens")
        wanted.setdefault((count - 1) // chunk_size, []).append(((count - 1) % chunk_size, dst))
    return wanted


def ssd_recurrent_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, dt_limit: tuple[float, float] = NO_DT_LIMIT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch of sequences, updating `state` in place.

    x: [B, H, P]; dt: [B, H] (before softplus); A, D, dt_bias: [H]; B, C: [B, G, N]; state: [B, H, P, N]
    fp32 (may be a view of the state pool, which is then updated where it lies).
    Returns (y [B, H, P] in x's dtype, state).
    """
    heads = x.shape[1]
    steps = step_sizes(dt, dt_bias, dt_limit)  # [B, H]
    Bh, Ch = _expand_groups(B, heads), _expand_groups(C, heads)  # [B, H, N]
    xdt = x.float() * steps.unsqueeze(-1)  # [B, H, P]
    state.mul_((steps * A.float()).exp()[..., None, None]).addcmul_(xdt.unsqueeze(-1), Bh.unsqueeze(-2))
    y = (state @ Ch.unsqueeze(-1)).squeeze(-1) + D.float()[:, None] * x.float()
    return y.to(x.dtype), state
