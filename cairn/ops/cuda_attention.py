"""FlashInfer's paged attention behind the contracts of cairn/ops/attention.py: reads the KV pages in place.

cairn's pool is one tensor per layer for keys and one for values, [num_pages, page_size, kv_heads,
head_dim]: FlashInfer's "NHD" layout as it is, passed as the (k, v) tuple, any page size. A sequence's
pages are described to FlashInfer in CSR form, built here from cairn's padded page tables:

    pages of sequence b   = ceil(context_len[b] / page_size)
    indptr  [B + 1] int32 = 0, then the running sum of those
    indices          int32 = each sequence's first `pages` entries of its page-table row, concatenated
    last_page_len [B] int32 = context_len[b] - (pages - 1) * page_size        (1 .. page_size)

Decode (`BatchDecodeWithPagedKVCacheWrapper`): `plan` (host work and one device sync) is done once per
step, not once per layer: the step's decode context lengths are one tensor for every layer
(ForwardBatch.decode_context_lens caches it), so the plan is kept with a weak reference to that tensor
and made again when another tensor comes. Prefill (`BatchPrefillWithPagedKVCacheWrapper`, causal; the
mask aligned so that query i sits at position context_len - L + i, which is cairn's contract for a
resumed prefix) is planned per call: one per layer and prefill segment, small beside the segment's work.

UNTESTED ON GPU (no GPU was lent when this was written): tests/test_cuda_attention.py checks the CSR
building and the plan reuse on CPU with a stand-in of FlashInfer's wrappers that computes with the
reference; benchmarks/gpu_check.py compares the real kernels with the references on a GPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from cairn.ops.optional import import_optional

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's float workspace per wrapper (its examples' size)


def paged_kv_csr(page_tables: torch.Tensor, context_lens: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [B+1], indices [sum of pages], last_page_len [B]), int32, from padded page tables [B, max_pages]
    and context lengths [B] (see the module docstring)."""
    pages = (context_lens.long() + page_size - 1) // page_size
    indptr = torch.zeros(pages.shape[0] + 1, dtype=torch.int32, device=page_tables.device)
    indptr[1:] = pages.cumsum(0)
    used = torch.arange(page_tables.shape[1], device=page_tables.device).unsqueeze(0) < pages.unsqueeze(1)
    indices = page_tables[used].to(torch.int32)  # row-major: each sequence's pages in order
    last = (context_lens.long() - (pages - 1) * page_size).to(torch.int32)
    return indptr, indices, last


class Wrapped:
    """One FlashInfer wrapper, made with its workspace on the device of the first call (not at start-up)."""

    def __init__(self, wrapper_class: Callable):
        self.wrapper_class, self._wrapper = wrapper_class, None

    def wrapper(self, device: torch.device):
        if self._wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrapper = self.wrapper_class(workspace, "NHD")
        return self._wrapper


class FlashInferDecode(Wrapped):
    """cairn.ops.attention.paged_decode_attention's contract on FlashInfer's batch decode."""

    def __init__(self, flashinfer):
        super().__init__(flashinfer.BatchDecodeWithPagedKVCacheWrapper)
        self._planned: tuple | None = None  # (weakref to the step's context lengths, the plan's shape key)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        wrapper = self.wrapper(q.device)
        shape = (q.shape[1], k_pool.shape[2], q.shape[2], k_pool.shape[1], scale, q.dtype, k_pool.dtype)
        if not self._is_planned(context_lens, shape):
            indptr, indices, last = paged_kv_csr(page_tables, context_lens, k_pool.shape[1])
            wrapper.plan(indptr, indices, last, q.shape[1], k_pool.shape[2], q.shape[2], k_pool.shape[1],
                              sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_pool.dtype)
            self._planned = (weakref.ref(context_lens), shape)
        return wrapper.run(q.contiguous(), (k_pool, v_pool))

    def _is_planned(self, context_lens: torch.Tensor, shape: tuple) -> bool:
        """Planned for this very tensor (alive, so not a new one at a reused address) and these shapes."""
        return self._planned is not None and self._planned[0]() is context_lens and self._planned[1] == shape


class FlashInferPrefill(Wrapped):
    """cairn.ops.attention.paged_prefill_attention's contract on FlashInfer's batch prefill over a paged KV
    (one sequence per call, causal, the queries the last L positions of the context)."""

    def __init__(self, flashinfer):
        super().__init__(flashinfer.BatchPrefillWithPagedKVCacheWrapper)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                 context_len: int, scale: float) -> torch.Tensor:
        dev = q.device
        lens = torch.tensor([context_len], dtype=torch.int32, device=dev)
        indptr, indices, last = paged_kv_csr(page_table[None], lens, k_pool.shape[1])
        qo_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=dev)
        wrapper = self.wrapper(dev)
        wrapper.plan(qo_indptr, indptr, indices, last, q.shape[1], k_pool.shape[2], q.shape[2], k_pool.shape[1],
                          causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_pool.dtype)
        return wrapper.run(q.contiguous(), (k_pool, v_pool))


def load() -> object | None:
    """The flashinfer package, or None when it is absent or fails to import."""
    return import_optional("flashinfer", "flashinfer", "reference paged attention (pages gathered)")


def kernels() -> dict[str, Callable]:
    """The attention fields of cairn.ops.Kernels that FlashInfer provides (empty when it does not import);
    their workspaces are allocated on the device of their first call."""
    flashinfer = load()
    if flashinfer is None:
        return {}
    return {"paged_decode_attention": FlashInferDecode(flashinfer),
            "paged_prefill_attention": FlashInferPrefill(flashinfer)}
