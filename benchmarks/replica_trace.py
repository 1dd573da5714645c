"""What the replicas found in Redis, turn by turn, and when each turn's writes landed (replica_bench --trace).

Two parts, both outside the servers (they only read Redis, as a replica's lookup would):

    RedisWatch      a thread scanning the Redis of the bench every `interval_s` for cairn keys: when each key
                    first appeared (client clock), its size, and each index entry's value (a small JSON); and
                    Redis's received bytes (INFO total_net_input_bytes) at every scan
    TracingRunner   the bench's runner, wrapped: each request's replica, send and end times, prompt ids and
                    what the cache reported

`turns(...)` joins them after a workload: per request, the deepest snapshot Redis held for its prompt when it
was sent (as a replica's lookup would have found it: every prefix position is probed, entries verified
against the prompt), the deepest it held at the end of the workload and how long after the send that one
landed, and the writes that followed the request: bytes, and the time from the request's end to its last
write landing (the write-behind's lag), next to the gap before the next request was sent.

What it is not: a measurement of the servers' own write queue (the lag here includes it: a write is
queued when the request is released, about when its last token is sent).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

from cairn.bench.conversation import BenchRequest
from cairn.bench.run import Served
from cairn.cache.remote.keys import entry_at, prefix_keys

RELEASE_SLACK_S = 0.2


class RedisWatch:
    def __init__(self, url: str, interval_s: float = 0.05):
        import redis

        self.redis = redis.Redis.from_url(url)
        self.interval_s = interval_s
        self.first_seen: dict[bytes, float] = {}  # key name -> perf_counter() when first seen
        self.sizes: dict[bytes, int] = {}  # segment key name -> bytes
        self.entries: dict[bytes, bytes] = {}  # index entry key name -> its value
        self.net_in: list[tuple[float, int]] = []  # (perf_counter(), total_net_input_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="redis-watch", daemon=True)

    def __enter__(self) -> RedisWatch:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # Redis restarting between setups: the next scan sees it
                self.scan()
            self._stop.wait(self.interval_s)

    def scan(self) -> None:
        now = time.perf_counter()
        new = [k for k in self.redis.scan_iter(match="cairn:*", count=1000) if k not in self.first_seen]
        for name in new:
            self.first_seen[name] = now
        entries = [k for k in new if b":e:" in k]
        if entries:
            self.entries.update({k: v for k, v in zip(entries, self.redis.mget(entries), strict=True) if v})
        for name in (k for k in new if b":s:" in k):
            self.sizes[name] = self.redis.strlen(name)
        self.net_in.append((now, int(self.redis.info("stats")["total_net_input_bytes"])))

    def namespace(self) -> str | None:
        return next((k.split(b":")[1].decode() for k in self.first_seen), None)


@dataclass
class Sent:
    index: int
    replica: int  # which runner served it (round robin), 0 behind a router
    label: str
    send_s: float
    end_s: float
    prompt_ids: list[int]
    cached_tokens: int
    resume_tier: str | None


class TracingRunner:
    """A runner recording each request's replica and times (see the module docstring)."""

    def __init__(self, runners: list):
        self.runners, self.tokenizer, self.sent = runners, runners[0].tokenizer, []

    def serve(self, request: BenchRequest) -> Served:
        replica = len(self.sent) % len(self.runners)
        start = time.perf_counter()
        served = self.runners[replica].serve(request)
        self.sent.append(Sent(len(self.sent), replica, request.label, start, time.perf_counter(), served.prompt_ids,
                              served.cache.cached_tokens, served.cache.resume_tier))
        return served


def snapshots_in_redis(watch: RedisWatch, tokens: list[int]) -> dict[int, float]:
    """{end: first seen} of every snapshot entry seen in Redis that this prompt's lookup would accept."""
    ns, out = watch.namespace(), {}
    if ns is None:
        return out
    for p, key in prefix_keys(tokens, range(1, len(tokens) + 1)).items():
        name = f"cairn:{ns}:e:{key.hex()}".encode()
        value = watch.entries.get(name)
        if value is None:
            continue
        with contextlib.suppress(ValueError):
            entry = entry_at(value, p, tokens)
            if entry is not None and entry.has_snapshot:
                out[entry.end] = min(out.get(entry.end, float("inf")), watch.first_seen[name])
    return out


def deepest_in_redis(watch: RedisWatch, tokens: list[int], before_s: float | None) -> tuple[int, float | None]:
    """(end, first seen) of the deepest snapshot entry for this prompt that Redis held before `before_s`
    (None: at any time seen); (0, None) when there was none."""
    held = {end: seen for end, seen in snapshots_in_redis(watch, tokens).items()
            if before_s is None or seen < before_s}
    return max(held.items(), default=(0, None))


def turns(sent: list[Sent], watch: RedisWatch) -> list[dict]:
    """One row per request (see the module docstring); times in seconds."""
    rows = []
    for i, s in enumerate(sent):
        written = [n for n in watch.first_seen if b":s:" in n and _owner(watch, n, sent) == i]
        last = max((watch.first_seen[n] for n in written), default=None)
        at_send, _ = deepest_in_redis(watch, s.prompt_ids, s.send_s)
        eventually, seen = deepest_in_redis(watch, s.prompt_ids, None)
        rows.append({
            "index": s.index, "label": s.label, "replica": s.replica, "prompt_tokens": len(s.prompt_ids),
            "cached_tokens": s.cached_tokens, "resume_tier": s.resume_tier,
            "redis_deepest_at_send": at_send, "redis_deepest_later": eventually,
            "later_landed_after_send_s": None if seen is None or eventually <= at_send else round(seen - s.send_s, 3),
            "segments_written": len(written), "bytes_written": sum(watch.sizes.get(n, 0) for n in written),
            "writes_done_after_end_s": None if last is None else round(last - s.end_s, 3),
            "gap_to_next_send_s": None if i + 1 == len(sent) else round(sent[i + 1].send_s - s.end_s, 3),
            "redis_snapshots_seen_s": {end: round(seen - s.send_s, 3)  # relative to the send
                                       for end, seen in sorted(snapshots_in_redis(watch, s.prompt_ids).items())}})
    return rows


def _owner(watch: RedisWatch, name: bytes, sent: list[Sent]) -> int | None:
    """The request whose release wrote this segment: the last one that ended before the segment landed (with
    RELEASE_SLACK_S for a release just before its last chunk reached the client)."""
    seen = watch.first_seen[name]
    ended = [s.index for s in sent if s.end_s - RELEASE_SLACK_S <= seen]
    return ended[-1] if ended else None


def redis_input_rate(watch: RedisWatch) -> float:
    """Peak bytes/s Redis received over any 0.25 s window of the scans (its write throughput as used)."""
    best, j = 0.0, 0
    samples = watch.net_in
    for i in range(len(samples)):
        while samples[i][0] - samples[j][0] > 0.25:
            j += 1
        if samples[i][0] > samples[j][0]:
            best = max(best, (samples[i][1] - samples[j][1]) / (samples[i][0] - samples[j][0]))
    return best


def print_turns(rows: list[dict]) -> None:
    print(f"{'#':>3} {'label':<22} {'rep':>3} {'prompt':>6} {'cached':>6} {'redis@send':>10} {'redis later':>11} "
          f"{'landed +s':>9} {'MB written':>10} {'done +s':>8} {'next in s':>9}  snapshots in Redis (end@s from send)")
    for r in rows:
        print(f"{r['index']:>3} {r['label'][:22]:<22} {r['replica']:>3} {r['prompt_tokens']:>6} "
              f"{r['cached_tokens']:>6} {r['redis_deepest_at_send']:>10} {r['redis_deepest_later']:>11} "
              f"{_f(r['later_landed_after_send_s']):>9} {r['bytes_written'] / 1e6:>10.1f} "
              f"{_f(r['writes_done_after_end_s']):>8} {_f(r['gap_to_next_send_s']):>9}  "
              + " ".join(f"{end}@{t:+.2f}" for end, t in r["redis_snapshots_seen_s"].items()))


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
