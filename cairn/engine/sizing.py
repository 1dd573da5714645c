"""Memory budgets the user left to cairn, resolved once at engine start-up from the machine and the model.

Which budget comes from where (each GiB flag given explicitly always wins):

    budget                        checkpoint default            demo-model default
    --kv-cache-gib                1                             0.125  (64k tokens of the demo's KV)
    --state-cache-gib             0.25                          1/64   (its 16 working slots)
    --device-snapshot-gib         1                             1/16   (about 160 demo snapshots)
    --host-cache-gib              min(25% of available RAM, 8)  min(that, 0.25)
    --device-memory-fraction F    the KV pool, working states and device snapshots share what is left of
                                  F x the device's memory once the weights are loaded, in the
                                  proportions of the three GiB budgets above (explicit or default)

"Available RAM" is MemAvailable when the engine starts; `--host-cache-gib 0` turns the host tier
off. On CPU the "device" is host RAM: its memory is the machine's, and what is in use is this
process's resident set. `resolve_sizes` returns a config whose budgets are all numbers, and logs
where each came from. What this is not: the pools themselves (cairn.memory, cairn.cache.tiers.pools).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from cairn.config import GIB, EngineConfig

log = logging.getLogger("cairn.sizing")  # the name of its start-up line (README), not the module path

HOST_RAM_FRACTION = 0.25  # of available RAM, for the host tier by default
HOST_CAP_GIB = 8.0  # ... and at most this (llama.cpp's server keeps an 8 GiB RAM cache by default)


@dataclass(frozen=True)
class Defaults:
    """The device budgets, in GiB, that a model gets when their flags are left out."""

    kv_cache_gib: float
    state_cache_gib: float
    device_snapshot_gib: float
    host_cap_gib: float  # the host tier's default never exceeds this


CHECKPOINT_DEFAULTS = Defaults(kv_cache_gib=1.0, state_cache_gib=0.25, device_snapshot_gib=1.0,
                               host_cap_gib=HOST_CAP_GIB)
DEMO_DEFAULTS = Defaults(kv_cache_gib=0.125, state_cache_gib=1 / 64, device_snapshot_gib=1 / 16, host_cap_gib=0.25)


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def device_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(total, in use) of the device's memory: a CUDA device's whole memory, or on CPU the machine's
    RAM and this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), _rss_bytes()


def default_host_gib(cap_gib: float, available_bytes: int) -> float:
    """min(HOST_RAM_FRACTION of available RAM, cap), rounded down to 1/64 GiB."""
    gib = min(HOST_RAM_FRACTION * available_bytes / GIB, cap_gib)
    return int(gib * 64) / 64


def resolve_sizes(config: EngineConfig, device: torch.device, is_demo: bool) -> EngineConfig:
    """`config` with every budget left to cairn (None) replaced by a number, and a log line saying which."""
    mem, cache = config.memory, config.cache
    defaults = DEMO_DEFAULTS if is_demo else CHECKPOINT_DEFAULTS
    device_gib = [mem.kv_cache_gib, mem.state_cache_gib, cache.device_snapshot_gib]
    device_gib = [d if g is None else g for g, d in zip(device_gib, (defaults.kv_cache_gib, defaults.state_cache_gib,
                                                                       defaults.device_snapshot_gib), strict=True)]
    why = ["given" if g is not None else ("demo default" if is_demo else "default")
           for g in (mem.kv_cache_gib, mem.state_cache_gib, cache.device_snapshot_gib)]
    if mem.device_memory_fraction is not None:
        device_gib = _share_fraction(mem.device_memory_fraction, device, device_gib)
        why = [f"share of --device-memory-fraction {mem.device_memory_fraction:g}"] * 3
    host_gib, host_why = cache.host_cache_gib, "given"
    if host_gib is None:
        available = available_ram_bytes()
        host_gib = default_host_gib(defaults.host_cap_gib, available)
        host_why = (f"default: {HOST_RAM_FRACTION:.0%} of {available / GIB:.1f} GiB available RAM, at most "
                    f"{defaults.host_cap_gib:g} GiB; --host-cache-gib 0 turns it off")
    kv_gib, state_gib, snap_gib = device_gib
    log.info("memory budgets: KV pool %.3g GiB (%s), working states %.3g GiB (%s), device snapshots %.3g GiB (%s), "
             "host tier %s", kv_gib, why[0], state_gib, why[1], snap_gib, why[2],
             f"{host_gib:.3g} GiB ({host_why})" if host_gib else "off")
    return dataclasses.replace(
        config, memory=dataclasses.replace(mem, kv_cache_gib=kv_gib, state_cache_gib=state_gib),
        cache=dataclasses.replace(cache, device_snapshot_gib=snap_gib, host_cache_gib=host_gib))


def _share_fraction(fraction: float, device: torch.device, weights_gib: list[float]) -> list[float]:
    """What `fraction` of the device leaves after what is in use, split in the proportions of `weights_gib`."""
    total, used = device_memory_bytes(device)
    budget = fraction * total - used
    if budget <= 0:
        raise ValueError(f"device_memory_fraction={fraction:g} leaves nothing for the pools: {used / GIB:.2f} GiB "
                         f"of the device's {total / GIB:.2f} GiB are in use (weights, other processes)")
    scale = budget / GIB / sum(weights_gib)
    return [g * scale for g in weights_gib]
