"""RouterOptions: the frozen flags of `cairn router` (the replica URLs are given with --replica)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cairn.config import ConfigError, check_at_least


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class RouterOptions:
    host: str = _f("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = _f(8080, "TCP port to listen on")
    probe_timeout_s: float = _f(1.0, "seconds a replica may take to answer the cache probe; then it is asked no "
                                     "more for this request and routed to by load alone")
    connect_timeout_s: float = _f(2.0, "seconds to connect to a replica; then it is taken out and the request "
                                       "retried on another")
    request_timeout_s: float = _f(600.0, "seconds a replica may go silent while answering a request")
    cooldown_s: float = _f(5.0, "a replica that failed is taken out for this long, then health-checked again")
    health_interval_s: float = _f(2.0, "how often each replica's /health is polled")
    queue_cost_s: float = _f(0.5, "seconds of estimated time to first token one request waiting or running on a "
                                  "replica counts for, when replicas are compared")
    max_request_bytes: int = _f(32 << 20, "largest request body accepted, in bytes; larger ones get 413 before "
                                          "any replica is asked (the router holds a body to probe and retry with)")
    header_timeout_s: float = _f(10.0, "seconds a client may take to send a request's line and headers; then 408 "
                                       "and the connection is closed (0: no limit)")
    body_timeout_s: float = _f(60.0, "seconds a client may take to send a request body; then 408 (0: no limit)")
    max_connections: int = _f(1024, "open client connections allowed at once; one more gets 503 and is closed "
                                    "(0: no cap)")
    allowed_hosts: str | None = _f(None, "comma-separated Host names the router, bound to a loopback address, "
                                         "answers besides localhost, 127.0.0.1, [::1] and --host (others get 421, "
                                         "as a DNS rebinding page sends), or '*' for any; default: none")
    remembered_prefixes: int = _f(1 << 17, "conversation prefixes (one per message) whose replica the router "
                                           "remembers, so that a conversation's next turn goes back there without "
                                           "probing the replicas; 0: probe for every request")

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65536), got {self.port}")
        check_at_least(self, {"remembered_prefixes": 0, "max_request_bytes": 1, "body_timeout_s": 0,
                              "header_timeout_s": 0, "max_connections": 0, "queue_cost_s": 0, "cooldown_s": 0},
                       positive=("probe_timeout_s", "connect_timeout_s", "request_timeout_s", "health_interval_s"))
