"""Prometheus metrics of one server (one CollectorRegistry per app, never the global one).

Recorded as requests happen:

    cairn_requests_total{endpoint, status}         HTTP requests by route and status code
    cairn_requests_finished_total{finish_reason}   stop / length / abort (client gone, shutdown) / error
    cairn_prompt_tokens_total                      prompt tokens of requests whose prefill is done
    cairn_cached_tokens_total{tier}                of which resumed from the cache, by resume tier (the
                                                   cache's own cairn_cache_cached_tokens_total counts every
                                                   resume when it is made: a request aborted before its
                                                   prefill ended, or admitted again, counts there too)
    cairn_computed_prompt_tokens_total             of which prefilled (prompt - cached)
    cairn_generation_tokens_total                  generated tokens (aborted requests' included)
    cairn_time_to_first_token_seconds              histogram: request received -> first token out
    cairn_inter_token_latency_seconds              histogram: between successive tokens of a stream
    cairn_request_duration_seconds                 histogram: request received -> finished

Read from the engine at scrape time (`EngineStats`, taken on the engine thread):

    cairn_num_requests_running, cairn_num_requests_waiting
    cairn_kv_pages_total, cairn_kv_pages_free, cairn_kv_pages_cached (held by the prefix cache)
    cairn_state_slots_total, cairn_state_slots_free    (working slots; snapshots live in the cache's tier)
    cairn_pool_used_bytes{pool="kv"|"state"}, cairn_pool_capacity_bytes{pool}
    cairn_engine_step_failures_total
    cairn_cache_*                                  whatever engine.cache_stats() reports, see below

Read from the interpreter at scrape time (a full collection walks every tracked object holding the
interpreter lock, pausing the engine's steps; the server freezes its start-up objects, see main):

    cairn_gc_collections_total{generation}         garbage collections by generation (2: full)
    cairn_gc_frozen_objects                        objects frozen out of the collector's reach at start-up

`engine.cache_stats()` is a typed `CacheStats` (cairn/cache/stats.py; None from NullCache, which
exports nothing). `cache_families` names each field's family in one table, CACHE_SERIES: counters
get `_total`, a dict field is one series per label value, a None field is left out, e.g.

    counters["snapshots_taken"] 12            -> cairn_cache_snapshots_taken_total 12
    tier_moves {"snapshot device->host": 2}   -> cairn_cache_tier_moves_total{kind="snapshot device->host"} 2
    snapshots_per_tier {"device": 7}          -> cairn_cache_num_snapshots{tier="device"} 7 (gauge)
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cairn.cache.stats import CacheStats
from cairn.engine.engine import Engine
from cairn.engine.outputs import RequestOutput

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)


@dataclass(frozen=True)
class EngineStats:
    """The engine's state at one moment; build it with `read` on the engine thread."""

    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_free: int
    kv_bytes_per_page: int
    state_slots_total: int
    state_slots_free: int
    state_bytes_per_slot: int
    kv_pages_cached: int = 0  # pages the prefix cache references (when idle: free + cached == total)
    cache: CacheStats | None = None  # engine.cache_stats()

    @classmethod
    def read(cls, engine: Engine) -> EngineStats:
        kv, states = engine.kv, engine.states
        return cls(engine.num_running, engine.num_waiting, kv.num_pages, kv.allocator.num_free, kv.bytes_per_page,
                   states.num_slots, states.num_free, states.bytes_per_slot, engine.num_cached_pages(),
                   engine.cache_stats())


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def engine_families(s: EngineStats) -> Iterator[Metric]:
    yield _gauge("cairn_num_requests_running", "Requests in the running batch", s.num_running)
    yield _gauge("cairn_num_requests_waiting", "Requests queued for admission", s.num_waiting)
    yield _gauge("cairn_kv_pages_total", "KV pages in the device pool", s.kv_pages_total)
    yield _gauge("cairn_kv_pages_free", "KV pages free in the device pool", s.kv_pages_free)
    yield _gauge("cairn_kv_pages_cached", "KV pages the prefix cache holds", s.kv_pages_cached)
    yield _gauge("cairn_state_slots_total", "Working recurrent-state slots", s.state_slots_total)
    yield _gauge("cairn_state_slots_free", "Working recurrent-state slots free", s.state_slots_free)
    used = GaugeMetricFamily("cairn_pool_used_bytes", "Bytes in use per device pool", labels=["pool"])
    used.add_metric(["kv"], (s.kv_pages_total - s.kv_pages_free) * s.kv_bytes_per_page)
    used.add_metric(["state"], (s.state_slots_total - s.state_slots_free) * s.state_bytes_per_slot)
    yield used
    capacity = GaugeMetricFamily("cairn_pool_capacity_bytes", "Bytes per device pool", labels=["pool"])
    capacity.add_metric(["kv"], s.kv_pages_total * s.kv_bytes_per_page)
    capacity.add_metric(["state"], s.state_slots_total * s.state_bytes_per_slot)
    yield capacity
    yield from cache_families(s.cache)


# (CacheStats field, or "disk.<field>" / "remote.<field>"; metric name after cairn_cache_; label name or None; gauge?)
CACHE_SERIES = (
    ("taken_by_source", "snapshots_taken_by", "source", False),
    ("restored_by_tier", "snapshots_restored_from", "tier", False),
    ("dropped_by_reason", "snapshots_dropped", "reason", False),
    ("resume_failures", "resume_failures", "reason", False),
    ("tier_moves", "tier_moves", "kind", False),
    ("tier_drops", "tier_drops", "reason", False),
    ("pinned_bytes", "pinned_bytes", "tier", True),
    ("pins", "pins", "event", False),
    ("snapshots_per_tier", "num_snapshots", "tier", True),
    ("snapshot_used_bytes", "snapshot_used_bytes", "tier", True),
    ("snapshot_budget_bytes", "snapshot_budget_bytes", "tier", True),
    ("num_tree_nodes", "num_tree_nodes", None, True),
    ("host_kv_used_bytes", "host_kv_used_bytes", None, True),
    ("disk.used_bytes", "disk_used_bytes", None, True),
    ("disk.num_segments", "num_disk_segments", None, True),
    ("disk.faults", "disk_faults", "reason", False),
    ("disk.forgotten", "disk_segments_forgotten", "reason", False),
    ("disk.operations", "disk_operations", "kind", False),
    ("disk.store_segments", "disk_store_segments", "event", False),
    ("disk.budget_bytes", "disk_budget_bytes", None, True),
    ("remote.used_bytes", "remote_used_bytes", None, True),
    ("remote.num_segments", "num_remote_segments", None, True),
    ("remote.faults", "remote_faults", "reason", False),
    ("remote.forgotten", "remote_segments_forgotten", "reason", False),
    ("remote.operations", "remote_operations", "kind", False),
    ("remote.budget_bytes", "remote_budget_bytes", None, True),
)


def _family(name: str, gauge: bool, label: str | None, value) -> Metric:
    kind, doc = (GaugeMetricFamily if gauge else CounterMetricFamily), f"prefix cache: {name}"
    if label is None:
        return kind(f"cairn_cache_{name}", doc, value=value)
    family = kind(f"cairn_cache_{name}", doc, labels=[label])
    for label_value, v in value.items():
        family.add_metric([str(label_value)], v)
    return family


def cache_families(stats: CacheStats | None) -> Iterator[Metric]:
    """One metric family per reported field of the cache's stats (CACHE_SERIES), plus each named counter."""
    if stats is None:
        return
    for name, value in stats.counters.items():
        yield _family(name.removesuffix("_total"), False, None, value)
    for path, name, label, gauge in CACHE_SERIES:
        owner, _, attr = path.rpartition(".")
        holder = getattr(stats, owner) if owner else stats
        value = None if holder is None else getattr(holder, attr)
        if value is not None:
            yield _family(name, gauge, label, value)


class EngineCollector(Collector):
    """Exports the EngineStats last handed to `update` (nothing before the first)."""

    def __init__(self):
        self.latest: EngineStats | None = None
        self.num_step_failures = 0

    def update(self, stats: EngineStats | None, num_step_failures: int) -> None:
        self.latest = stats
        self.num_step_failures = num_step_failures

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("cairn_engine_step_failures", "engine.step() exceptions survived",
                                  value=self.num_step_failures)
        if self.latest is not None:
            yield from engine_families(self.latest)


class GcCollector(Collector):
    """Exports the interpreter's garbage-collection counts (what makes a long pause in a step), and the
    number of objects the server froze at start-up (set by whoever froze them: counting them again
    would walk the frozen list, tens of milliseconds holding the interpreter lock)."""

    def __init__(self):
        self.num_frozen_objects = 0

    def collect(self) -> Iterator[Metric]:
        collections = CounterMetricFamily("cairn_gc_collections", "Garbage collections by generation",
                                          labels=["generation"])
        for generation, stats in enumerate(gc.get_stats()):
            collections.add_metric([str(generation)], stats["collections"])
        yield collections
        yield _gauge("cairn_gc_frozen_objects", "Objects frozen out of the collector's reach at start-up",
                     self.num_frozen_objects)


class ServerMetrics:
    """The metrics of one app; `render` gives the Prometheus text exposition."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cairn_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.finished = Counter("cairn_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("cairn_prompt_tokens", "Prompt tokens of prefilled requests", registry=r)
        self.cached_tokens = Counter("cairn_cached_tokens", "Prompt tokens resumed from the cache", ["tier"],
                                     registry=r)
        self.computed_prompt_tokens = Counter("cairn_computed_prompt_tokens", "Prompt tokens prefilled",
                                              registry=r)
        self.generation_tokens = Counter("cairn_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("cairn_time_to_first_token_seconds", "Request received to first token",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("cairn_inter_token_latency_seconds", "Time between successive tokens",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.duration = Histogram("cairn_request_duration_seconds", "Request received to finished",
                                  buckets=DURATION_BUCKETS_S, registry=r)
        self.engine = EngineCollector()
        r.register(self.engine)
        self.gc = GcCollector()
        r.register(self.gc)

    def observe_output(self, out: RequestOutput, is_first: bool, duration_s: float) -> None:
        """Count one output of a request: its new tokens; with the first, the prompt's tokens (prefill is
        done); with the finished one, the finish reason and duration. Aborted requests keep what they made."""
        self.generation_tokens.inc(len(out.delta_token_ids))
        if is_first:
            cached = out.cache.cached_tokens
            self.prompt_tokens.inc(out.num_prompt_tokens)
            if cached:
                self.cached_tokens.labels(out.cache.resume_tier or "unknown").inc(cached)
            self.computed_prompt_tokens.inc(max(0, out.num_prompt_tokens - cached))
        if out.request_finished:
            self.finished.labels(out.finish_reason or "unknown").inc()
            self.duration.observe(duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
