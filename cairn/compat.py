"""The compatibility digest: what must match for a stored state (a disk segment) to be valid for this engine.

The engine computes it once at start-up (only with a disk cache: hashing the weights reads them all)
and hands the cache the string; the cache names its disk namespace by it and never reads a segment
written under another. What this is not: the namespace or the segment format (cairn/cache/disk/).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from cairn.cache.disk.segment import FORMAT_VERSION
from cairn.model.config import ModelConfig


def weights_digest(model: torch.nn.Module) -> str:
    """Content digest of a model's parameters (names, dtypes, shapes and bytes), computed once at start-up."""
    h = hashlib.blake2b(digest_size=32)
    for name, param in sorted(model.named_parameters(remove_duplicate=False), key=lambda kv: kv[0]):
        t = param.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def compat_digest(weights: str, cfg: ModelConfig, dtype: torch.dtype, page_size: int, prefill_block: int = 0,
                  prefill_kernels: str = "") -> str:
    """The namespace of a disk cache: everything that must match for a stored state to be valid here.

    `prefill_block` (exact resumption) is part of it when set: a state computed in other blocks is
    valid but not bit for bit what a cold run here computes. So, with it, are the kernels that multiply a
    prefill's rows when they are not F.linear on the weights as loaded (`layout.prefill_kernels`: the AVX2
    gemv path sums in another order), so that a cache written under another --weight-layout is not resumed."""
    fields = {"weights": weights, "config": dataclasses.asdict(cfg), "dtype": str(dtype),
              "state_dtype": "float32", "page_size": page_size, "format": FORMAT_VERSION}
    if prefill_block:
        fields["prefill_block"] = prefill_block
        if prefill_kernels:
            fields["prefill_kernels"] = prefill_kernels
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
