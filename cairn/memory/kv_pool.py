"""The paged KV pool of the full-attention layers, preallocated from a byte budget.

Layout, one tensor each for keys and values:

    k, v: [num_attention_layers, num_pages, page_size, num_kv_heads, head_dim]  (model dtype)

Token position p of a sequence lives in page page_table[p // page_size] at offset p % page_size.
Pages are reference counted by `cairn.memory.pages.PageAllocator`, which knows nothing of tensors.
"""

from __future__ import annotations

import torch

from cairn.memory.pages import PageAllocator


class KVPool:
    """Keys and values of every attention layer, in pages."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # Zeroed, not uninitialised: batched decode reads whole pages and masks the positions past each
        # sequence's length, and a masked NaN bit pattern would still poison the weighted sum.
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
