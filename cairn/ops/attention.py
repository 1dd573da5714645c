"""Reference kernels for attention over a paged KV pool.

A pool holds `num_pages` pages of `page_size` tokens: k_pool, v_pool: [num_pages, page_size, kv_heads,
head_dim]. A sequence's page table lists its pages in position order, so token position p lives at
page_table[p // page_size], offset p % page_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_pages(pool: torch.Tensor, page_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, kv_heads, head_dim]."""
    num_pages = -(-length // pool.shape[1])
    return pool[page_table[:num_pages]].flatten(0, 1)[:length]


def paged_prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
    context_len: int, scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole context.

    q: [L, H, D] are the queries of positions [context_len - L, context_len), whose keys and values are
    already written to the pool. Returns [L, H, D].
    """
    new_len = q.shape[0]
    # [1, heads, tokens, dim]: SDPA takes its fused CPU kernel only for 4-D inputs
    k = gather_pages(k_pool, page_table, context_len).transpose(0, 1).unsqueeze(0)
    v = gather_pages(v_pool, page_table, context_len).transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)
    if new_len == context_len:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(context_len - new_len, context_len, device=q.device).unsqueeze(1)
        mask = torch.arange(context_len, device=q.device).unsqueeze(0) <= rows
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One new token per sequence. q: [B, H, D]; page_tables: [B, max_pages]; context_lens: [B]."""
    batch = q.shape[0]
    k = k_pool[page_tables].flatten(1, 2)  # [B, S, KVH, D]
    v = v_pool[page_tables].flatten(1, 2)
    mask = torch.arange(k.shape[1], device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.view(batch, 1, 1, -1),
        scale=scale, enable_gqa=True,
    )
    return out.squeeze(2)
