"""SpeedMeter: the measured speeds the resume planner estimates with.

Per tier, the bandwidth of bringing bytes to the device (device: a copy within device memory; host:
host to device; disk: read, verify and copy), and the model's prefill speed in tokens per second.
Start-up values come from each tier (the factory measures the page tiers' with real copies,
`measure_copy_bytes_per_s`, and the others start from conservative defaults); every observed
restore and prefill then moves them by an exponential average.
"""

from __future__ import annotations

import time

import torch

from cairn.cache.policy.planner import Speeds


class SpeedMeter:
    def __init__(self, bandwidth: dict[str, float] | None = None, prefill_tokens_per_s: float = 2000.0,
                 smoothing: float = 0.3):
        self.bandwidth = dict(bandwidth or {})  # tier name -> bytes/s (each tier's start-up value)
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.smoothing = smoothing  # weight of a new observation in the running average

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth[tier] = self._blend(self.bandwidth[tier], nbytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= 32 and seconds > 0:
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, num_tokens / seconds)

    def snapshot(self) -> Speeds:
        return Speeds(dict(self.bandwidth), self.prefill_tokens_per_s)


def measure_copy_bytes_per_s(src: torch.Tensor, dst: torch.Tensor, repeats: int = 20) -> float:
    """Bandwidth of dst.copy_(src): the best of `repeats` timed copies after one untimed one (which pays
    the first touch of dst's pages). A small copy is quick to preempt on a busy machine (its threads
    wait for each other), so one slow timing would make restores look slower than recomputing; the best
    of many is what an undisturbed copy costs. Synchronised on CUDA."""
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        if dst.is_cuda or src.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return src.numel() * src.element_size() / max(best, 1e-9)
