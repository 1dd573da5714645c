"""CUDA graphs for decode: the capture backend and which kernels may run under a graph (`--cuda-graphs`, off).

A capture backend turns a step (a function of static buffers returning a static output) into a replay:
`capture(step, static) -> replay`, called once per batch bucket by cairn/decode_graphs.py.

    CudaGraphBackend       torch.cuda.CUDAGraph: the step warmed up on a side stream, captured once, and
                           every later call is `graph.replay()` (the step's Python does not run again)
    CheckingGraphBackend   cairn/ops/graph_check.py: a stand-in on any device that runs the step again at
                           every replay and proves it graph-safe (the CPU tests use it)

UNTESTED ON GPU: no GPU was lent when this was written. The static-buffer path is checked on CPU by
the stand-in; the capture call itself (`torch.cuda.graph`) has never run. benchmarks/gpu_check.py
compares replay with the eager path on the first GPU that is lent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from cairn.ops import REFERENCE, Kernels, attention, is_cpu_op

# The Kernels fields a decode step calls. Each must be graph-safe: no host sync, no host-dependent control
# flow, no allocation that outlives the step. The reference kernels are (the checking stand-in runs them);
# the field's adapters are refused until a GPU run has checked them under a graph (docs/gpu.md).
DECODE_FIELDS = ("recurrent_gated_delta_rule", "causal_conv1d_update", "paged_decode_attention",
                 "mamba_conv1d_update", "ssd_recurrent_step", "gdn_decode_op", "add_rms_norm", "norm_rotary_write")


def device_refusal(device: torch.device) -> str | None:
    """Why `--cuda-graphs` cannot run on `device` (one line), or None on CUDA."""
    if device.type != "cuda":
        return f"--cuda-graphs needs a CUDA device (this one is {device.type}); drop the flag"
    return None


def refusal(kernels: Kernels, ffn_types: tuple[str, ...]) -> str | None:
    """Why the graph path cannot run this model with these kernels (one line), or None when it can. cairn's compiled
    CPU ops stand where the reference does (is_cpu_op): they run on a CPU only, where the graph path is the checking
    stand-in's, and a CUDA device never gets them."""
    for field in DECODE_FIELDS:
        value = getattr(kernels, field)
        if value is not getattr(REFERENCE, field) and not is_cpu_op(value):
            return (f"--cuda-graphs: the decode kernel {field} of {kernels.name} is not known to be graph-safe "
                    "(only the reference kernels are, so far); drop --fast-kernels or --cuda-graphs")
    if "moe" in ffn_types:
        return ("--cuda-graphs: this model's MoE layers route on the host (expert counts read back each step), "
                "which a CUDA graph cannot replay; drop the flag")
    return None


def graph_kernels(kernels: Kernels) -> Kernels:
    """The kernel set to run under graphs: decode attention reads every sequence's pages by its table, never a
    view of consecutive pages chosen on the host (attention.consecutive_run, a host read on CPU)."""
    return dataclasses.replace(kernels, paged_decode_attention=attention.paged_decode_attention_by_table)


class CudaGraphBackend:
    """One torch.cuda.CUDAGraph per captured step, all sharing one memory pool (only one replays at a time)."""

    name = "cuda graphs"

    def __init__(self, warmup_runs: int = 2):
        self.warmup_runs = warmup_runs
        self.pool = None  # the graphs' shared private memory pool, made at the first capture

    def capture(self, step: Callable[[], torch.Tensor], static: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Warm `step` up on a side stream (torch requires it: lazy initialisations, library workspaces),
        capture it, and return the replay, which returns the output tensor of the capture, refilled.
        `static` is unused: a real graph needs no list of the buffers it reads."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                step()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's unsafe calls fail the capture, not a cache tier's background thread
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
