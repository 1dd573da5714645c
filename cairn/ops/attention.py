"""Reference kernels for attention over a paged KV pool.

A pool holds `num_pages` pages of `page_size` tokens: k_pool, v_pool: [num_pages, page_size, kv_heads,
head_dim]. A sequence's page table lists its pages in position order, so token position p lives at
page_table[p // page_size], offset p % page_size.

Reading a sequence's keys and values out of the pool copies them (an index with a list of pages),
once per layer and step: at a 32k-token context, 2 x 32 MiB per attention layer of the 0.8B shape
for one decode token. When a sequence's pages are consecutive ids (a fresh request in a pool that
hands out the lowest free page first), `gather_pages` returns a view of them instead: the same
values in the same layout, so attention computes bit for bit what it computes on the copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cairn.ops import norm


def consecutive_run(pages: torch.Tensor) -> slice | None:
    """pages as a slice of the pool when they are consecutive ids (checked on CPU tensors only: on a
    GPU the check would wait for the device), else None."""
    if pages.device.type != "cpu" or pages.numel() == 0:
        return None
    first = int(pages[0])
    run = slice(first, first + pages.numel())
    return run if torch.equal(pages, torch.arange(run.start, run.stop)) else None


def gather_pages(pool: torch.Tensor, page_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, kv_heads, head_dim]; a view of the pool
    when its pages are consecutive, else a copy."""
    pages = page_table[:-(-length // pool.shape[1])]
    run = consecutive_run(pages)
    return (pool[run] if run is not None else pool[pages]).flatten(0, 1)[:length]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary: the first rotary_dim dims of each head rotated in halves. x: [T, heads, head_dim];
    cos, sin: [T, rotary_dim] in x's dtype."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    rot = rot * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return torch.cat([rot, rest], dim=-1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write a step's k, v [T, kv_heads, head_dim] into one layer's pool at each token's flat index."""
    k_pool.view(-1, *k.shape[1:])[slot_mapping] = k
    v_pool.view(-1, *v.shape[1:])[slot_mapping] = v


def norm_rotary_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, zero_centred: bool, cos: torch.Tensor, sin: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The gated attention's inputs: q [T, H, D] and k [T, KVH, D] RMSNormed over D (norm.rms_norm) and
    rotated (`rotate`), k and v [T, KVH, D] written to the pool at slot_mapping [T] (`write_kv`); returns
    the rotated q [T, H, D]. q may be a strided view (Qwen's [q_h | gate_h] rows); nothing is modified but
    the pools."""
    q = rotate(norm.rms_norm(q, q_weight, eps, zero_centred), cos, sin)
    write_kv(rotate(norm.rms_norm(k, k_weight, eps, zero_centred), cos, sin), v, k_pool, v_pool, slot_mapping)
    return q


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
    """One new token per sequence. q: [B, H, D]; page_tables: [B, max_pages]; context_lens: [B].

    Several sequences are gathered into one padded batch (a copy); one alone reads its pages in place
    when they are consecutive (see the module docstring)."""
    batch = q.shape[0]
    run = consecutive_run(page_tables[0]) if batch == 1 else None
    if run is None:
        return paged_decode_attention_by_table(q, k_pool, v_pool, page_tables, context_lens, scale)
    k, v = k_pool[run].flatten(0, 1).unsqueeze(0), v_pool[run].flatten(0, 1).unsqueeze(0)  # [1, S, KVH, D]
    return _attend(q, k, v, context_lens, scale)


def paged_decode_attention_by_table(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """paged_decode_attention with every sequence's pages gathered by its table (a copy), never a view chosen
    on the host: no host read, no sync, the same ops whatever the pages (the CUDA graph path's; the same values
    as the view, so the same result)."""
    k = k_pool[page_tables].flatten(1, 2)  # [B, S, KVH, D]
    v = v_pool[page_tables].flatten(1, 2)
    return _attend(q, k, v, context_lens, scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [B, H, D] over k, v [B, S, KVH, D], each row's first context_lens[b] keys: [B, H, D]."""
    batch = q.shape[0]
    mask = torch.arange(k.shape[1], device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.view(batch, 1, 1, -1),
        scale=scale, enable_gqa=True,
    )
    return out.squeeze(2)
