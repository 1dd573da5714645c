"""The paged KV pool of the full-attention layers, preallocated from a byte budget.

Layout, one tensor each for keys and values:

    k, v: [num_attention_layers, num_pages, page_size, num_kv_heads, head_dim]  (model dtype)

Token position p of a sequence lives in page page_table[p // page_size] at offset p % page_size.
Pages are reference counted: a page is shared by every sequence and cache node that lists it and is
free again when the last one lets go. `PageAllocator` holds that bookkeeping and knows nothing of
tensors, so the cache and scheduler can be tested without a model.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than asked for."""


class PageAllocator:
    """Free list and reference counts of `num_pages` pages. Page ids are 0..num_pages-1."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with refcount 1. Raises OutOfPages (allocating nothing) when fewer are free."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise AssertionError(f"incref of free page {p}")
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> int:
        """Drop one reference from each page; returns how many pages became free."""
        freed = 0
        for p in pages:
            if self.refcount[p] <= 0:
                raise AssertionError(f"decref of free page {p}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Free list and refcounts agree; with expected_refs, every count equals the expected one."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        for p in range(self.num_pages):
            if (self.refcount[p] == 0) != (p in free):
                raise AssertionError(f"page {p}: refcount {self.refcount[p]} but free={p in free}")
            if expected_refs is not None and self.refcount[p] != expected_refs.get(p, 0):
                raise AssertionError(f"page {p}: refcount {self.refcount[p]}, owners {expected_refs.get(p, 0)}")


class KVPool:
    """Keys and values of every attention layer, in pages."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's keys and values, every layer (copy-on-write of a partly shared page)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def read_pages(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the given pages: ([layers, len(pages), page_size, kvh, d],) * 2."""
        index = torch.tensor(pages, dtype=torch.long, device=self.k.device)
        return self.k[:, index].clone(), self.v[:, index].clone()

    def write_pages(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        index = torch.tensor(pages, dtype=torch.long, device=self.k.device)
        self.k[:, index] = k.to(self.k.device, self.k.dtype)
        self.v[:, index] = v.to(self.v.device, self.v.dtype)
