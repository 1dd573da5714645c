"""The compatibility digest: what must match for a stored state (a disk segment) to be valid for this engine.

The engine computes it once at start-up (only with a disk cache: hashing the weights reads them all)
and hands the cache the string; the cache names its disk namespace by it and never reads a segment
written under another. What this is not: the namespace or the segment format (cairn/cache/disk/).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch

from cairn.cache.segments.segment import FORMAT_VERSION
from cairn.model.config import ModelConfig
from cairn.ops.cpu_isa import cpu_flags

# the /proc/cpuinfo flags that choose oneDNN's (and cairn's C++ ops') instruction paths for a matrix product:
# two machines differing in one of them can sum a bf16 product in another order
_KERNEL_FLAGS = ("avx2", "fma", "avx_vnni", "avx_ne_convert", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                 "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def weights_digest(model: torch.nn.Module) -> str:
    """Content digest of a model's parameters (names, dtypes, shapes and bytes), computed once at start-up."""
    h = hashlib.blake2b(digest_size=32)
    for name, param in sorted(model.named_parameters(remove_duplicate=False), key=lambda kv: kv[0]):
        t = param.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def kernel_platform(device: torch.device, cpu_path: str = "none") -> str:
    """What chooses the instructions a product runs on this machine: torch's version and, on a CPU, its dispatch
    level, the matrix-relevant CPU flags, oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA) and the instruction path of cairn's
    compiled ops (`cpu_path`, cairn/ops/cpu_isa.py: a machine forced onto a lower path sums in that path's order);
    on a GPU its name and compute capability with CUDA's version. Not the thread count: a bf16 prefill gave the
    same bits at 1 to 8 threads."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return (f"torch {torch.__version__} cuda {torch.version.cuda} {torch.cuda.get_device_name(device)} "
                f"sm_{major}{minor}")
    flags = cpu_flags()
    isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return " ".join([f"torch {torch.__version__} {device.type} {torch.backends.cpu.get_cpu_capability()}",
                     *(f for f in _KERNEL_FLAGS if f in flags), f"cairn-cpu-path {cpu_path}",
                     *([f"isa<={isa_cap}"] if isa_cap else [])])


def compat_digest(weights: str, cfg: ModelConfig, dtype: torch.dtype, page_size: int, prefill_block: int = 0,
                  prefill_kernels: str = "", platform: str = "") -> str:
    """The namespace of a disk cache: everything that must match for a stored state to be valid here.

    `prefill_block` (exact resumption) is part of it when set: a state computed in other blocks is
    valid but not bit for bit what a cold run here computes. So, with it, are the kernels that multiply a
    prefill's rows when they are not F.linear on the weights as loaded (`layout.prefill_kernels`: the AVX2
    gemv path sums in another order), so that a cache written under another --weight-layout is not resumed, and
    the machine's `platform` (kernel_platform): a bf16 product on an AMX CPU, an AVX2 one or a GPU sums in its own
    order, so replicas on mixed hardware sharing a Redis tier (or a disk cache moved between machines) keep
    their exact states apart. Without exact resumption a state from other hardware is as valid as a resume from
    any position (within rounding), and every machine shares the namespace."""
    fields = {"weights": weights, "config": dataclasses.asdict(cfg), "dtype": str(dtype),
              "state_dtype": "float32", "page_size": page_size, "format": FORMAT_VERSION}
    if prefill_block:
        fields["prefill_block"] = prefill_block
        if prefill_kernels:
            fields["prefill_kernels"] = prefill_kernels
        fields["platform"] = platform
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
