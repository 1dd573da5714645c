"""build_cache: the prefix cache an engine runs with, assembled from CacheOptions.

Device tier always (when the cache is on), host tier with host_cache_gib > 0 (page-locked on CUDA),
disk tier with disk_cache set (its namespace is the compatibility digest the engine computed, see
cairn/compat.py). Start-up speeds for the planner are measured here with real copies of one state slot.
"""

from __future__ import annotations

import logging

import torch

from cairn.cache.base import NullCache, PrefixCache
from cairn.cache.disk.store import DiskStore
from cairn.cache.disk.tier import DiskTier
from cairn.cache.hybrid import HybridPrefixCache
from cairn.cache.policy.placement import PlacementOptions
from cairn.cache.policy.speeds import SpeedMeter, measure_copy_bytes_per_s
from cairn.cache.tiers.pools import HostKVBank, PoolSnapshotTier
from cairn.cache.tiers.tier_set import TierSet
from cairn.config import CacheOptions
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool

log = logging.getLogger(__name__)


def placement_options(opts: CacheOptions, page_size: int, prefill_block: int = 0) -> PlacementOptions:
    return PlacementOptions(
        interval_tokens=opts.snapshot_interval, at_messages=opts.snapshot_at_messages,
        at_prompt_end=opts.snapshot_at_prompt_end, at_request_end=opts.snapshot_at_request_end,
        at_branch=opts.snapshot_at_branch, policy=opts.snapshot_policy, min_gap_tokens=opts.snapshot_min_gap,
        page_size=page_size, align=prefill_block)


def build_cache(opts: CacheOptions, kv: KVPool, states: StatePool, vocab_size: int, digest: str = "",
                model_name: str | None = None, prefill_block: int = 0) -> PrefixCache:
    """Raises DiskStoreError (a one-line message) when the disk cache directory cannot be used.
    `digest`: the compatibility digest naming the disk namespace (needed when opts.disk_cache is set);
    `prefill_block`: the engine's exact-resumption block (0: off); snapshots and resume points follow it."""
    if not opts.prefix_cache:
        return NullCache()
    device = states.device
    pinned = device.type == "cuda"
    dev_tier = PoolSnapshotTier("device", states, opts.device_snapshot_bytes, vocab_size, device)
    host = host_kv = disk = None
    if opts.host_cache_bytes > 0:
        host = PoolSnapshotTier("host", states, opts.host_cache_bytes // 2, vocab_size, "cpu", pinned)
        host_kv = HostKVBank(kv, opts.host_cache_bytes // 2, pinned)
    if opts.disk_cache:
        if not digest:
            raise ValueError("a disk cache needs the compatibility digest of the model (cairn/compat.py)")
        store = DiskStore(opts.disk_cache, digest, opts.disk_cache_bytes,
                          compression=None if opts.disk_compression == "none" else opts.disk_compression,
                          create_parents=opts.disk_cache_create_parents, model_name=model_name)
        disk = DiskTier(store, kv.page_size, opts.disk_write_through)
        log.info("disk cache: %s/%s (%.1f GiB budget%s)", opts.disk_cache, digest[:16], opts.disk_cache_gib,
                 ", read-only: another server manages it" if store.readonly else "")
    tiers = TierSet(kv, dev_tier, host, host_kv, disk)
    log.info("prefix cache: %d device snapshot slots (%.1f MiB), host %s, disk %s, snapshot every %d tokens",
             dev_tier.num_slots, opts.device_snapshot_bytes / 2**20,
             f"{opts.host_cache_gib:g} GiB" if host else "off", opts.disk_cache or "off", opts.snapshot_interval)
    return HybridPrefixCache(kv, states, tiers, placement_options(opts, kv.page_size, prefill_block),
                             _measure(states, host))


def _measure(states: StatePool, host: PoolSnapshotTier | None) -> SpeedMeter:
    """Start-up bandwidths from copies of one state slot's recurrent state, device->device and host->device."""
    src = _largest(states.read_slot(0))
    bandwidth = {"device": measure_copy_bytes_per_s(src, torch.empty_like(src))}
    if host is not None:
        bandwidth["host"] = measure_copy_bytes_per_s(_largest(host.pool.read_slot(0)), torch.empty_like(src))
    return SpeedMeter(bandwidth)


def _largest(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return max(tensors.values(), key=lambda t: t.numel() * t.element_size())
