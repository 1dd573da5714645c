"""PageAllocator: free list and reference counts of KV pages, with no tensors (torch-free).

A page is shared by every running sequence and cache node that lists it, each holding one
reference, and is free again when the last one lets go. The cache and scheduler do their
bookkeeping through this class, so they can be tested without a model or torch.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than asked for."""


class PageAllocator:
    """Free list and reference counts of `num_pages` pages. Page ids are 0..num_pages-1."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id first
        self.reserved: list[int] = []  # pages out of circulation for good (reserve): one reference each, never freed

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

    def reserve(self) -> int:
        """One page taken out of circulation for good (the CUDA graph path's scratch page, which padding rows
        write): it holds one reference that nothing releases, so it is never handed out again; a decref of it
        is an error. Raises OutOfPages when none is free."""
        [page] = self.alloc(1)
        self.reserved.append(page)
        return page

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
            if self.refcount[p] == 1 and p in self.reserved:
                raise AssertionError(f"decref of reserved page {p}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Free list and refcounts agree; with expected_refs, every count equals the expected one (plus the
        reserved pages' own reference)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        for p in range(self.num_pages):
            if (self.refcount[p] == 0) != (p in free):
                raise AssertionError(f"page {p}: refcount {self.refcount[p]} but free={p in free}")
            if expected_refs is not None and self.refcount[p] != expected_refs.get(p, 0) + (p in self.reserved):
                raise AssertionError(f"page {p}: refcount {self.refcount[p]}, owners {expected_refs.get(p, 0)}")
