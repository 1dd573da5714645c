"""CacheStats: what a prefix cache reports, as typed fields (server/metrics.py turns them into Prometheus).

Counters are monotonic since start-up; gauges are levels. Each field says its metric; a dict field is
one series per label value. NullCache reports None. Torch-free, a leaf module.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DiskStats:
    """A segment tier (disk, remote), when there is one."""

    used_bytes: int  # gauge cairn_cache_disk_used_bytes
    num_segments: int  # gauge cairn_cache_num_disk_segments
    faults: dict[str, int] = field(default_factory=dict)  # counter cairn_cache_disk_faults_total{reason}
    forgotten: dict[str, int] = field(default_factory=dict)  # counter ..._disk_segments_forgotten_total{reason}
    # counter cairn_cache_disk_operations_total{kind}: the tier's segments_written, write_failed (the store
    # refused it), write_unreadable (the node's KV could not be read to write it), read_ok, read_bad (failed
    # verification or could not be read), read_missing (the store had let it go), read_vanished (the store found
    # its value gone: evicted, expired, deleted), read_unavailable (the store did not answer: Redis down; the
    # segment stays known), orphan_segments (indexed at start-up without their parent: never
    # resumable; the disk store's lock holder deletes them); the remote tier adds lookups and lookup_hits, and
    # segments_queued (written behind the requests: its segments_written counts those Redis accepted)
    operations: dict[str, int] = field(default_factory=dict)
    # counter cairn_cache_disk_store_segments_total{event} (the disk store's, store_index.py's COUNTS): puts (files
    # written), rewrites (of those, a stored key's file replaced to add a snapshot), evictions (the budget),
    # removed (orphans), dropped (a bad or vanished file), scanned (found on disk at start-up or a rescan). The
    # gauge num_segments == scanned + puts - rewrites - evictions - removed - dropped. Empty for the remote tier.
    store_segments: dict[str, int] = field(default_factory=dict)
    # gauge cairn_cache_disk_budget_bytes: the bytes the tier's evictions fit now: the disk budget, lowered while a
    # full filesystem holds less (store.py's effective budget); the remote tier's byte bound on what it believes
    # Redis holds (Redis's maxmemory, or max_bytes). None (not exported): the remote tier without a bound
    budget_bytes: int | None = None


@dataclass(frozen=True)
class CacheStats:
    # counters cairn_cache_<name>_total: snapshots_taken, snapshots_restored, cached_tokens, kv_pages_evicted, ...
    counters: dict[str, int] = field(default_factory=dict)
    taken_by_source: dict[str, int] = field(default_factory=dict)  # counter ..._snapshots_taken_by_total{source}
    restored_by_tier: dict[str, int] = field(default_factory=dict)  # counter ..._snapshots_restored_from_total{tier}
    dropped_by_reason: dict[str, int] = field(default_factory=dict)  # counter ..._snapshots_dropped_total{reason}
    # counter cairn_cache_resume_failures_total{reason}: planned resumes abandoned at admission (then planned again,
    # shallower) because a segment could not be read: "corrupt" (failed verification, or an I/O error), "evicted"
    # (its value gone from its store: Redis evicted or expired it, its disk file was deleted) or "unavailable"
    # (Redis did not answer)
    resume_failures: dict[str, int] = field(default_factory=dict)
    # counter cairn_cache_tier_moves_total{kind}: demotions ("snapshot device->host", "kv host->disk", ...) and
    # what resumes put back on the device ("snapshot disk->device", "kv disk->device", ...)
    tier_moves: dict[str, int] = field(default_factory=dict)
    tier_drops: dict[str, int] = field(default_factory=dict)  # counter cairn_cache_tier_drops_total{reason}
    # gauge cairn_cache_pinned_bytes{tier}: bytes of the snapshots each page tier holds ahead of the others for
    # clients' cache breakpoints (their TTLs, within --breakpoint-pin-share of its budget; policy/pins.py)
    pinned_bytes: dict[str, int] = field(default_factory=dict)
    # counter cairn_cache_pins_total{event}: pinned (a snapshot stored at a breakpoint), refreshed (a request read
    # one again), expired (its TTL ran out: ordinary retention from then on), demoted (a held pin moved down a
    # tier because nothing unpinned was left there: that tier's pins want more room)
    pins: dict[str, int] = field(default_factory=dict)
    snapshots_per_tier: dict[str, int] = field(default_factory=dict)  # gauge cairn_cache_num_snapshots{tier}
    snapshot_used_bytes: dict[str, int] = field(default_factory=dict)  # gauge ..._snapshot_used_bytes{tier}
    snapshot_budget_bytes: dict[str, int] = field(default_factory=dict)  # gauge ..._snapshot_budget_bytes{tier}
    num_tree_nodes: int = 0  # gauge cairn_cache_num_tree_nodes
    host_kv_used_bytes: int | None = None  # gauge cairn_cache_host_kv_used_bytes (with a host tier)
    disk: DiskStats | None = None
    remote: DiskStats | None = None  # the Redis tier: cairn_cache_remote_faults_total{reason}, ...
