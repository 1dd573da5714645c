"""The operator's log lines: one when a request finishes, and a periodic stats line while the engine is busy.

    finished req-7: prompt 1210 (cached 1184 from device, resumed at 1184 message), output 64, ttft 0.041 s,
        decode 112.3 tok/s, total 0.61 s, finish stop
    stats: running 3, waiting 0, prompt 412.0 tok/s, generation 96.5 tok/s, cache hits 97.8% (device 95.1%,
        host 2.7%), KV pool 38% used, working slots 3/16, device snapshots 41% of budget, host 12%

(each one line). With `--log-format json` the same facts arrive as fields of the JSON object
(`extra={"fields": ...}`, see cairn.logs). The stats line covers the requests whose prefill finished
and the tokens generated since the previous stats line, and is written at most every
`interval_s` seconds, only when something ran in between. The engine calls these hooks; they read
the sequence and the pools and change nothing. What this is not: the Prometheus metrics
(cairn.server.metrics), which count the same things for scraping.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from cairn.sequence import Sequence

log = logging.getLogger("cairn.engine")


def finished_fields(seq: Sequence, now_s: float) -> dict:
    """What the finished line says about one request (times from its arrival, in seconds)."""
    c = seq.cache
    ttft_s = None if seq.first_token_s is None else seq.first_token_s - seq.arrival_s
    decode_s = (seq.last_token_s - seq.first_token_s) if seq.first_token_s and seq.last_token_s else 0.0
    n_out = seq.num_output_tokens
    return {"request_id": seq.request_id, "prompt_tokens": seq.num_prompt_tokens, "cached_tokens": c.cached_tokens,
            "resume_tier": c.resume_tier, "resume_position": c.resume_position, "resume_source": c.resume_source,
            "output_tokens": n_out, "ttft_s": None if ttft_s is None else round(ttft_s, 4),
            "decode_tok_per_s": round((n_out - 1) / decode_s, 1) if n_out > 1 and decode_s > 0 else None,
            "total_s": round(now_s - seq.arrival_s, 4), "finish_reason": seq.finish_reason}


def finished_message(f: dict) -> str:
    cached = (f"cached {f['cached_tokens']} from {f['resume_tier']}, resumed at {f['resume_position']} "
              f"{f['resume_source']}" if f["cached_tokens"] else "cached 0")
    ttft = "-" if f["ttft_s"] is None else f"{f['ttft_s']:.3f} s"
    decode = "-" if f["decode_tok_per_s"] is None else f"{f['decode_tok_per_s']:.1f} tok/s"
    return (f"finished {f['request_id']}: prompt {f['prompt_tokens']} ({cached}), output {f['output_tokens']}, "
            f"ttft {ttft}, decode {decode}, total {f['total_s']:.2f} s, finish {f['finish_reason']}")


class ActivityLog:
    """Counts what the engine did since the last stats line; writes the finished and stats lines."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s  # 0: no stats lines
        self._clock = clock
        self._since_s = clock()
        self._prompt_tokens = 0  # prompt tokens of requests whose prefill finished in the window
        self._computed_tokens = 0  # ... of which computed (the rest came from the cache)
        self._cached_by_tier: Counter[str] = Counter()
        self._generated_tokens = 0

    def first_token(self, seq: Sequence) -> None:
        """A request's prefill finished (its first token is out)."""
        self._prompt_tokens += seq.num_prompt_tokens
        self._computed_tokens += seq.num_prompt_tokens - seq.cache.cached_tokens
        if seq.cache.cached_tokens:
            self._cached_by_tier[seq.cache.resume_tier or "?"] += seq.cache.cached_tokens

    def token(self) -> None:
        self._generated_tokens += 1

    def finished(self, seq: Sequence) -> None:
        if log.isEnabledFor(logging.INFO):
            fields = finished_fields(seq, self._clock())
            log.info(finished_message(fields), extra={"fields": {"event": "request_finished", **fields}})

    def maybe_stats(self, pools: Callable[[], dict], num_running: int, num_waiting: int) -> None:
        """Write the stats line when `interval_s` has passed and something ran; `pools()` (called only
        then) gives the pool-use fields."""
        now = self._clock()
        elapsed = now - self._since_s
        if not self.interval_s or elapsed < self.interval_s:
            return
        if self._prompt_tokens or self._generated_tokens or num_running or num_waiting:
            fields = {"event": "stats", "running": num_running, "waiting": num_waiting,
                      "prompt_tok_per_s": round(self._prompt_tokens / elapsed, 1),
                      "computed_tok_per_s": round(self._computed_tokens / elapsed, 1),
                      "generation_tok_per_s": round(self._generated_tokens / elapsed, 1),
                      "cache_hit_rate": self._rate(sum(self._cached_by_tier.values())),
                      "cache_hit_rate_by_tier": {t: self._rate(n) for t, n in sorted(self._cached_by_tier.items())},
                      **pools()}
            log.info(stats_message(fields), extra={"fields": fields})
        self._since_s = now
        self._prompt_tokens = self._computed_tokens = self._generated_tokens = 0
        self._cached_by_tier.clear()

    def _rate(self, n: int) -> float | None:
        return round(n / self._prompt_tokens, 4) if self._prompt_tokens else None


def stats_message(f: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    tiers = ", ".join(f"{t} {pct(r)}" for t, r in f["cache_hit_rate_by_tier"].items())
    pools = ", ".join(f"{name.removesuffix('_use').replace('_', ' ')} {pct(v)}"
                      for name, v in f.items() if name.endswith("_use"))
    return (f"stats: running {f['running']}, waiting {f['waiting']}, prompt {f['prompt_tok_per_s']:.1f} tok/s "
            f"(computed {f['computed_tok_per_s']:.1f}), generation {f['generation_tok_per_s']:.1f} tok/s, "
            f"cache hits {pct(f['cache_hit_rate'])}{f' ({tiers})' if tiers else ''}, {pools}")
