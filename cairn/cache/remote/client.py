"""Connecting to Redis, the circuit breaker that keeps a down or slow Redis off the request path, and asking a
server (or a cluster's primaries) its maxmemory (`maxmemory`).

URL forms (`--remote-cache`):

    redis://[[user]:[password]@]HOST:PORT[/DB]     one Redis / Valkey server (DB defaults to 0)
    rediss://...                                    the same over TLS
    redis+cluster://HOST:PORT  (or rediss+cluster://, or any of the above with ?cluster=true)
                                                    a Redis Cluster, reached through one of its nodes
                                                    (redis-py's RedisCluster; a cluster has no DB number)

Every call has a short socket timeout and no retries: a failure is counted and opens the breaker,
which skips every call for `cooldown_s` (callers see a miss) and logs one line per outage. A command Redis
answers with an error (a write refused at its maxmemory under the noeviction policy, a read-only replica) is
counted as "refused" and logged at most once a minute; it does not open the breaker: Redis is reachable, and
its reads still answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.5  # each Redis call (connect, or one command / pipeline round trip)
DEFAULT_COOLDOWN_S = 5.0  # how long the breaker stays open after a failure
REFUSED_LOG_INTERVAL_S = 60.0  # at most one line this often for commands Redis refuses
FAILED = object()  # what GuardedRedis returns when Redis was not reached
_TRUE = ("1", "true", "yes", "on")


def split_url(url: str) -> tuple[str, bool]:
    """(a URL redis-py accepts, whether it names a Redis Cluster); ValueError on another scheme."""
    parts = urlsplit(url)
    scheme, cluster = parts.scheme, False
    if scheme.endswith("+cluster"):
        scheme, cluster = scheme.removesuffix("+cluster"), True
    if scheme not in ("redis", "rediss"):
        raise ValueError(f"--remote-cache must be a redis://, rediss:// or redis+cluster:// URL, got {redacted(url)!r}")
    query = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "cluster":
            cluster = cluster or value.lower() in _TRUE
        else:
            query.append((name, value))
    return urlunsplit((scheme, parts.netloc, parts.path, urlencode(query), parts.fragment)), cluster


def connect(url: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A redis-py client for `url` (nothing is sent yet), with `timeout_s` on every call and no retries."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    plain_url, cluster = split_url(url)
    kwargs = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    if cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(plain_url, **kwargs)
    return redis.Redis.from_url(plain_url, **kwargs)


def _refused(error: Exception) -> bool:
    """Whether Redis answered the command with an error of its own (OOM at maxmemory, READONLY, MISCONF, NOPERM),
    rather than not answering or a cluster that cannot serve the slot (CLUSTERDOWN, TRYAGAIN: unavailable)."""
    from redis import exceptions

    unavailable = (exceptions.ClusterDownError, exceptions.TryAgainError, exceptions.AskError,
                   exceptions.ClusterCrossSlotError)
    return isinstance(error, exceptions.ResponseError) and not isinstance(error, unavailable)


def redacted(url: str) -> str:
    """The URL without its password (in the user part, or redis-py's `?password=`), for log lines."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    query = [(k, "***" if k.lower() == "password" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query, safe="*") if query else parts.query,
                       parts.fragment))


class Breaker:
    """Open after a failure: `allow()` is False for `cooldown_s`, then one call is let through to test
    the server again. One warning when an outage starts, one info line when a call succeeds again."""

    def __init__(self, name: str, cooldown_s: float = DEFAULT_COOLDOWN_S):
        self.name, self.cooldown_s = name, cooldown_s
        self.num_opened = 0  # outages seen
        self._open_until = 0.0  # time.monotonic() before which calls are skipped
        self._down = False  # the last call failed
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self._open_until

    def allow(self) -> bool:
        with self._lock:
            if time.monotonic() < self._open_until:
                return False
            if self._down:  # let this one call through; the others wait for its outcome
                self._open_until = time.monotonic() + self.cooldown_s
            return True

    def failure(self, error: Exception) -> None:
        with self._lock:
            self._open_until = time.monotonic() + self.cooldown_s
            if self._down:
                return
            self._down = True
            self.num_opened += 1
        log.warning("remote cache %s unavailable (%s: %s): serving from local tiers, retrying every %gs",
                    self.name, type(error).__name__, error, self.cooldown_s)

    def success(self) -> None:
        with self._lock:
            if not self._down:
                return
            self._down, self._open_until = False, 0.0
        log.info("remote cache %s reachable again", self.name)


class GuardedRedis:
    """Every call to Redis through the breaker: a failure (or an open breaker) is counted through
    `on_fault(reason)` ("unavailable", "timeout", "breaker_open") and returns FAILED, never raises. The
    client connects on first use, inside the guard (a cluster client asks for its slot map then)."""

    def __init__(self, url: str, timeout_s: float, cooldown_s: float, on_fault: Callable[[str], None], client=None):
        self.url, self.timeout_s, self.on_fault = url, timeout_s, on_fault
        self.client = client
        self.breaker = Breaker(redacted(url), cooldown_s)
        self._lock = threading.Lock()
        self._refused_logged_at: float | None = None  # time.monotonic() of the last "refused" line

    def call(self, fn: Callable):
        """fn(client), or FAILED."""
        if not self.breaker.allow():
            self.on_fault("breaker_open")
            return FAILED
        try:
            with self._lock:
                if self.client is None:
                    self.client = connect(self.url, self.timeout_s)
            result = fn(self.client)
        except Exception as e:  # redis-py's errors, and OSError from a socket: all a miss
            if _refused(e):  # Redis answered, with an error: reachable, so the breaker stays closed
                self.on_fault("refused")
                self.breaker.success()
                self._log_refused(e)
                return FAILED
            self.on_fault("timeout" if "Timeout" in type(e).__name__ else "unavailable")
            self.breaker.failure(e)
            return FAILED
        self.breaker.success()
        return result

    def _log_refused(self, error: Exception) -> None:
        now = time.monotonic()
        if self._refused_logged_at is not None and now - self._refused_logged_at < REFUSED_LOG_INTERVAL_S:
            return
        self._refused_logged_at = now
        log.warning("remote cache %s refused a command (%s: %s): what it holds is still read; writes are counted "
                    "as refused (at most one line a minute)", self.breaker.name, type(error).__name__, error)

    def pipelined(self, commands: list[tuple], ttl_s: int | None = None):
        """("set", name, value) / ("setpx", name, value, ms) / ("setnx", name, value) / ("get" | "delete" | "exists" |
        "touch", name) commands in one round trip (a cluster client splits them by node): their results, or FAILED.
        `ttl_s` applies to the sets; a setpx expires after its own `ms` milliseconds, a setnx never. A touch marks the
        key used now for Redis's LRU / LFU eviction (with `ttl_s`, an EXPIRE that also restarts its time to live)."""
        def run(client):
            pipe = client.pipeline(transaction=False)
            for op, name, *value in commands:
                if op == "set":
                    pipe.set(name, value[0], ex=ttl_s)
                elif op == "setpx":
                    pipe.set(name, value[0], px=value[1])
                elif op == "setnx":
                    pipe.set(name, value[0], nx=True)
                elif op == "get":
                    pipe.get(name)
                elif op == "exists":
                    pipe.exists(name)
                elif op == "touch" and ttl_s is None:
                    pipe.touch(name)
                elif op == "touch":
                    pipe.expire(name, ttl_s)
                else:  # "delete"
                    pipe.delete(name)
            return pipe.execute()
        return self.call(run)

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        except Exception:
            log.debug("closing the Redis client failed", exc_info=True)


def maxmemory(client) -> int | None:
    """Redis's maxmemory in bytes (0: no limit) by CONFIG GET, or from INFO memory where CONFIG is refused (managed
    Redis services rename or forbid it); None when neither answers. A cluster's is its primaries' sum (0 when one
    has no limit)."""
    from redis import exceptions

    cluster = hasattr(client, "get_primaries")
    target = {"target_nodes": client.PRIMARIES} if cluster else {}
    for read in (lambda: client.config_get("maxmemory", **target), lambda: client.info("memory", **target)):
        try:
            answer = read()
        except exceptions.ResponseError:
            continue
        per_node = list(answer.values()) if cluster and "maxmemory" not in answer else [answer]
        try:
            limits = [int(node["maxmemory"]) for node in per_node]
        except (KeyError, TypeError, ValueError):
            continue
        return 0 if not limits or 0 in limits else sum(limits)
    return None
