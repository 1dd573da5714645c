"""The compatibility digest and the machine: exact resumption keeps states computed on other hardware apart.

A bf16 product sums in the order its instruction path chooses (AVX2, AVX512-BF16, AMX, a GPU), so a state one
machine computed under --prefill-block is not bit for bit what a cold prefill on another computes. Replicas on
mixed hardware share a Redis tier (or a disk cache is copied between machines): each platform gets its own
namespace there. Without exact resumption every machine shares one (a resume is within rounding anyway).
"""

from __future__ import annotations

import pytest
import torch

import cairn.engine.build
from cairn.engine.compat import compat_digest, kernel_platform
from cairn.engine.llm import LLM
from cairn.model.config import ModelConfig
from cairn.ops.cpu_isa import cpu_flags

OPTS = dict(kv_cache_gib=0.01, state_cache_gib=0.01, page_size=8)


def namespaces(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("block", [64, 0])
def test_a_disk_cache_written_on_other_hardware_is_resumed_only_without_exact_resumption(tmp_path, monkeypatch, block):
    """Two machines that differ in their CPU's matrix instructions write one cache directory (a shared volume, a
    copied directory): with exact resumption each gets its namespace, without it they share one."""
    for platform in ("torch 2.13.0 cpu AVX2 avx2 fma", "torch 2.13.0 cpu AVX512 avx2 fma avx512f avx512_bf16"):
        monkeypatch.setattr(cairn.engine.build, "kernel_platform", lambda device, path, platform=platform: platform)
        with LLM(**OPTS, dtype="bfloat16", prefill_block=block, disk_cache=str(tmp_path)):
            pass
    assert len(namespaces(tmp_path)) == (2 if block else 1)


def test_the_platform_names_torch_and_the_cpus_matrix_instructions():
    platform = kernel_platform(torch.device("cpu"))
    assert platform.startswith(f"torch {torch.__version__} cpu {torch.backends.cpu.get_cpu_capability()}")
    for flag in ("avx2", "avx512_bf16", "amx_bf16"):
        assert (flag in platform.split()) == (flag in cpu_flags())


def test_onednns_isa_cap_is_part_of_the_platform(monkeypatch):
    """ONEDNN_MAX_CPU_ISA caps oneDNN's instruction path below what the CPU has: another order of sums."""
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = kernel_platform(torch.device("cpu"))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernel_platform(torch.device("cpu")) == plain + " isa<=AVX2"


def test_the_platform_is_part_of_the_digest_only_with_a_prefill_block():
    cfg = ModelConfig("qwen3_next", 256, 64, ("linear_attention", "full_attention"), ("dense", "dense"), 1e-6,
                      False, 4096)
    digest = lambda block, platform: compat_digest("w", cfg, torch.bfloat16, 16, block, "", platform)  # noqa: E731
    assert digest(512, "a") != digest(512, "b")
    assert digest(0, "a") == digest(0, "b")
