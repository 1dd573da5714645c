"""Reference (pure PyTorch) kernels for the gated delta rule, the recurrence inside Gated DeltaNet.

Per value head, with a state S of shape [k_dim, v_dim], each token t does

    S <- exp(g_t) * S                      (gated decay, g_t <= 0 in log space)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T (delta rule: write only what S does not predict)
    o_t = S^T q_t

`chunk_gated_delta_rule` computes the same thing 64 tokens at a time with the WY/UT transform
(prefill); `recurrent_gated_delta_rule` takes one step for a batch of sequences (decode). Both
normalise q and k with L2 inside, scale q by k_dim**-0.5 and keep the state in fp32.
These are the references a fast kernel must match on outputs and final states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _expand_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each q/k head serves num_v_heads // num_k_heads consecutive value heads."""
    groups = num_v_heads // q.shape[-2]
    if groups == 1:
        return q, k
    return q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, capture_at: Sequence[tuple[int, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill segment.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; initial_state: [Hv, Dk, Dv] fp32.
    capture_at: (count, out) pairs, count in [1, T]: the state after that many tokens is written into
    `out` ([Hv, Dk, Dv] fp32, e.g. a snapshot slot), so a snapshot inside the segment needs no split. A
    count that ends a 64-token chunk (or the segment) gets exactly the state the computation carries on
    from, so resuming there computes what continuing would have.
    Returns (o [T, Hv, Dv] in v's dtype, final_state [Hv, Dk, Dv] fp32).
    """
    out_dtype = v.dtype
    seq_len, num_v_heads, _ = v.shape
    q, k = _expand_heads(q, k, num_v_heads)
    # -> [H, T, D] in fp32
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    g, beta = g.transpose(0, 1).float(), beta.transpose(0, 1).float()
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    pad = (-seq_len) % CHUNK_SIZE
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads, total = g.shape
    n = total // CHUNK_SIZE
    q, k, v = (x.reshape(heads, n, CHUNK_SIZE, -1) for x in (q, k, v))
    g, beta = g.reshape(heads, n, CHUNK_SIZE), beta.reshape(heads, n, CHUNK_SIZE)

    cum = g.cumsum(-1)  # log decay from chunk start to each position
    causal = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # (I + strictly_lower(beta_i k_i.k_j decay_ij)) X = rhs, solved for the values and decayed keys
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()

    wanted: dict[int, list[tuple[int, torch.Tensor]]] = {}  # chunk -> (its last token included, out)
    for count, dst in capture_at:
        if not 1 <= count <= seq_len:
            raise ValueError(f"capture at {count} is outside the segment's {seq_len} tokens")
        wanted.setdefault((count - 1) // CHUNK_SIZE, []).append(((count - 1) % CHUNK_SIZE, dst))

    state = initial_state.float().clone()
    out = torch.empty_like(u)
    last = (seq_len - 1) % CHUNK_SIZE  # the segment's last token within its last chunk
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        after = state * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
        for t, dst in wanted.get(i, ()):
            if t == CHUNK_SIZE - 1 or (i == n - 1 and t == last):
                dst.copy_(after)  # at a chunk's end: the very state the next chunk starts from, bit for bit
                continue
            # inside a chunk: the chunk's update, cut at t
            k_to_t = k[:, i, : t + 1] * (cum[:, i, t, None] - cum[:, i, : t + 1]).exp().unsqueeze(-1)
            torch.mul(state, cum[:, i, t].exp()[:, None, None], out=dst)
            dst.baddbmm_(k_to_t.transpose(-1, -2), v_new[:, : t + 1])
        state = after
    out = out.reshape(heads, total, -1)[:, :seq_len].transpose(0, 1)
    return out.to(out_dtype), state


# The decode step passes over each sequence's state several times (read for the prediction, decay,
# rank-1 update). Taken a block of rows at a time, a block stays in the core's L2 cache between those
# passes, so the state goes through memory about twice (read, write back) instead of five times; at
# batch 16 of the 0.8B shape a layer's states are 16 MiB, at batch 1 one block.
STATE_BLOCK_BYTES = 1 << 20


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch of sequences, updating `state` in place.

    q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dk, Dv] fp32 (may be a view of
    the state pool, which is then updated where it lies). Returns (o [B, Hv, Dv] in v's dtype, state).

    The state is the largest thing a decode step touches after the weights (1 MiB per sequence and
    layer at the 0.8B shape), so it is read once for both S^T k and S^T q, then decayed and updated in
    place; with S' = d S + k delta^T the output needs no second read: o = S'^T q = d S^T q + (k . q) delta.
    """
    out_dtype = v.dtype
    batch, heads, dk, dv = state.shape
    rows = batch * heads
    q, k = _expand_heads(q, k, heads)
    q = l2norm(q.float()).mul_(dk ** -0.5)
    k = l2norm(k.float())
    qk = torch.stack([k, q], dim=-2).view(rows, 2, dk)
    kq = (k * q).sum(-1).view(rows, 1, 1)
    k_col = k.view(rows, dk, 1)
    decay = g.float().exp().reshape(rows, 1, 1)
    v = v.float().reshape(rows, 1, dv)
    beta = beta.float().reshape(rows, 1, 1)
    flat = state.view(rows, dk, dv)
    out = torch.empty(rows, 1, dv, dtype=torch.float32, device=state.device)
    block = max(1, STATE_BLOCK_BYTES // (dk * dv * state.element_size()))
    for lo in range(0, rows, block):
        r = slice(lo, lo + block)
        read = torch.bmm(qk[r], flat[r]).mul_(decay[r])  # [rows, 2, Dv]: d S^T k, d S^T q
        delta = (v[r] - read[:, :1]).mul_(beta[r])
        torch.addcmul(read[:, 1:], kq[r], delta, out=out[r])
        flat[r].mul_(decay[r]).baddbmm_(k_col[r], delta)
    return out.view(batch, heads, dv).to(out_dtype), state


def no_decode_op(*tensors: torch.Tensor) -> None:
    """The reference's `Kernels.gdn_decode_op`: never a fused decode op, so every decode step runs the kernels
    above (a CPU path's value is cpu_gdn.op_for, through a CpuOp)."""
    return None
