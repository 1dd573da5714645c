"""The router's view of its replicas, and the choice of one per request.

    Replica         one replica's URL, health, when it may be tried again, and what it last said
    Probe           a replica's answer to POST /v1/cache/probe (resume position, estimate, queue)
    rank(...)       the order in which to try replicas for one request: a pure function
    by_load(...)    the order without probes: fewest requests in flight from this router first

The choice: score = estimated time to first token (from the replica's own planner, which prices what
it can resume and from which tier) + queue_cost_s per request waiting or running there. Replicas whose
score is within TIE_FRACTION of the best are ties: among them the deepest resume position wins, then
the one after the last replica chosen (round robin, so cold traffic spreads). Replicas that did not
answer the probe come after those that did. Torch-free, HTTP-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

TIE_FRACTION = 0.1  # scores within 10% (plus TIE_S) of the best count as equal
TIE_S = 0.005


@dataclass
class Replica:
    url: str  # base URL, e.g. http://127.0.0.1:8001 (no trailing slash)
    healthy: bool = True  # its /health answered 200 last time, and no request failed on it since
    down_until: float = 0.0  # time.monotonic() before which it is not tried
    last_error: str | None = None  # why it was last taken out
    num_routed: int = 0  # requests sent to it
    num_failed: int = 0  # requests that failed on it before anything was streamed
    num_in_flight: int = 0  # requests sent to it by this router whose answer has not ended yet

    def available(self, now: float | None = None) -> bool:
        return self.healthy and (now or time.monotonic()) >= self.down_until

    def take_out(self, why: str, cooldown_s: float) -> None:
        self.healthy, self.last_error = False, why
        self.down_until = time.monotonic() + cooldown_s
        self.num_failed += 1

    def report(self) -> dict:
        return {"url": self.url, "healthy": self.available(), "routed": self.num_routed, "failed": self.num_failed,
                "in_flight": self.num_in_flight, "last_error": self.last_error}


@dataclass(frozen=True)
class Probe:
    position: int = 0  # tokens it would resume
    est_ttft_s: float | None = None  # its planner's estimate (None: it has no cache or did not say)
    waiting: int = 0  # requests queued there
    running: int = 0  # requests running there
    tokens: int = 0  # prompt length as it tokenized it


@dataclass
class Ranker:
    queue_cost_s: float  # see RouterOptions.queue_cost_s
    _next: int = field(default=0)  # round-robin cursor over replica indices

    def score(self, probe: Probe) -> float:
        est = probe.est_ttft_s if probe.est_ttft_s is not None else 0.0
        return est + self.queue_cost_s * (probe.waiting + probe.running)

    def rank(self, replicas: list[Replica], probes: dict[str, Probe | None]) -> list[Replica]:
        """Replicas to try, best first; `probes[url]` is None when that replica did not answer its probe."""
        n = len(replicas)
        turn = {r.url: (i - self._next) % n for i, r in enumerate(replicas)} if n else {}
        answered = [r for r in replicas if probes.get(r.url) is not None]
        silent = sorted((r for r in replicas if probes.get(r.url) is None), key=lambda r: turn[r.url])
        if not answered:
            ordered = silent
        else:
            best = min(self.score(probes[r.url]) for r in answered)
            cutoff = best * (1 + TIE_FRACTION) + TIE_S
            ties = [r for r in answered if self.score(probes[r.url]) <= cutoff]
            rest = [r for r in answered if r not in ties]
            ordered = (sorted(ties, key=lambda r: (-probes[r.url].position, turn[r.url]))
                       + sorted(rest, key=lambda r: (self.score(probes[r.url]), turn[r.url])) + silent)
        if ordered:
            self._next = (replicas.index(ordered[0]) + 1) % n
        return ordered

    def by_load(self, replicas: list[Replica]) -> list[Replica]:
        """Replicas to try when none was probed: fewest requests in flight from this router first, ties in
        round-robin order (the cursor is not moved: the replicas were not compared)."""
        n = len(replicas)
        return sorted(replicas, key=lambda r: (r.num_in_flight, (replicas.index(r) - self._next) % n))
