"""build_cache: the prefix cache an engine runs with, assembled from CacheOptions.

Device tier always (when the cache is on), host tier with host_cache_gib > 0 (page-locked on CUDA),
disk tier with disk_cache set (its namespace is the compatibility digest the engine computed, see
cairn/engine/compat.py), the Redis tier shared by replicas with remote_cache set (same namespace), last. Start-up
speeds for the planner are measured here with real copies into device memory.
"""

from __future__ import annotations

import logging

import torch

from cairn.cache.base import NullCache, PrefixCache
from cairn.cache.disk.namespace import ReadBuffer
from cairn.cache.disk.offline import namespace_names
from cairn.cache.disk.store import DiskStore, format_size
from cairn.cache.hybrid import HybridPrefixCache
from cairn.cache.policy.placement import PlacementOptions
from cairn.cache.policy.speeds import SpeedMeter, measure_copy_bytes_per_s
from cairn.cache.remote.client import redacted
from cairn.cache.remote.store import RedisSegmentStore
from cairn.cache.segments.tier import SegmentTier
from cairn.cache.tiers.base import LowerTier
from cairn.cache.tiers.pools import DeviceTier, HostKVBank, HostTier
from cairn.cache.tiers.tier_set import TierSet
from cairn.cache.tree.nodes import DISK, REMOTE
from cairn.config import CacheOptions
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool

log = logging.getLogger(__name__)
# bytes/s of bringing each tier's bytes to the device until measured (page tiers are, at start-up)
DEVICE_BANDWIDTH, HOST_BANDWIDTH, DISK_BANDWIDTH = 20e9, 5e9, 0.5e9
REMOTE_BANDWIDTH = 0.25e9  # bytes/s of a restore from Redis until measured (the planner then observes loads)
MEASURE_BYTES = 16 * 2**20  # the start-up copy that measures a page tier's bandwidth (see _measure)


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
    device = DeviceTier(states, opts.device_snapshot_bytes, vocab_size, kv, DEVICE_BANDWIDTH)
    lower: list[LowerTier] = []  # slower tiers, in the order demotion tries them
    if opts.host_cache_bytes > 0:
        host_kv = HostKVBank(kv, opts.host_cache_bytes // 2, pinned)
        lower.append(HostTier(states, opts.host_cache_bytes // 2, vocab_size, host_kv, HOST_BANDWIDTH, pinned))
    if opts.disk_cache:
        lower.append(_disk_tier(opts, kv.page_size, digest, model_name))
    if opts.remote_cache:
        store = RedisSegmentStore(opts.remote_cache, _digest(digest), kv.page_size)
        lower.append(SegmentTier(store, kv.page_size, name=REMOTE, bandwidth=REMOTE_BANDWIDTH))
    tiers = TierSet(device, lower, pin_share=opts.breakpoint_pin_share)
    _measure(states, tiers)
    log.info("prefix cache: %d device snapshot slots (%.1f MiB), host %s, disk %s, remote %s, snapshot every %d "
             "tokens", device.num_slots, opts.device_snapshot_bytes / 2**20,
             f"{opts.host_cache_gib:g} GiB" if opts.host_cache_bytes > 0 else "off", opts.disk_cache or "off",
             redacted(opts.remote_cache) if opts.remote_cache else "off", opts.snapshot_interval)
    return HybridPrefixCache(kv, states, tiers, placement_options(opts, kv.page_size, prefill_block),
                             SpeedMeter({tier.name: tier.bandwidth for tier in tiers.tiers}))


def _digest(digest: str) -> str:
    assert digest, "the engine computes the compatibility digest whenever a disk or remote cache is set"
    return digest


def _disk_tier(opts: CacheOptions, page_size: int, digest: str, model_name: str | None) -> SegmentTier:
    digest = _digest(digest)
    store = DiskStore(opts.disk_cache, digest, opts.disk_cache_bytes,
                      compression=None if opts.disk_compression == "none" else opts.disk_compression,
                      create_parents=opts.disk_cache_create_parents, model_name=model_name)
    log.info("disk cache: %s/%s (%s budget%s)", opts.disk_cache, digest[:16], format_size(store.budget_bytes),
             f"; read-only: {store.readonly_reason}" if store.readonly else "")
    others = [name[:16] for name in namespace_names(opts.disk_cache) if name != digest]
    if others:  # another model's, dtype's or settings' (a weight layout, a prefill block): never read here
        log.info("disk cache: %s also holds %d namespace(s) of other models, dtypes or settings (%s%s), never read "
                 "by this server (cairn cache ls lists them)", opts.disk_cache, len(others), ", ".join(others[:4]),
                 ", ..." if len(others) > 4 else "")
    return SegmentTier(store, page_size, opts.disk_write_through, DISK, DISK_BANDWIDTH, ReadBuffer())


def _measure(states: StatePool, tiers: TierSet) -> None:
    """Start-up bandwidths of the page tiers: the best of repeated copies of max(one state slot, 16 MiB) into
    device memory, from device memory (the device tier) and from the host tier's memory (page-locked when
    it is). A buffer that size reads the memory's bandwidth, which a restore of a whole slot approaches; a
    copy of one small tensor on a busy machine mostly times the wake-up of the copy's threads, which made
    restoring a short prompt look slower than recomputing it."""
    nbytes = max(states.bytes_per_slot, MEASURE_BYTES)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=states.device)
    for tier in tiers.page_tiers:
        if not tier.num_slots:
            continue
        pool = states if tier is tiers.device else tier.pool
        pinned = pool.is_pinned and pool.device.type == "cpu"
        src = torch.ones(nbytes, dtype=torch.uint8, device=pool.device, pin_memory=pinned)
        tier.bandwidth = measure_copy_bytes_per_s(src, dst)
