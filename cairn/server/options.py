"""ServerOptions: the frozen flags of `cairn serve` (the engine's own flags live in `cairn.config`).

`cairn.cli` turns each field into a flag (`shutdown_timeout_s` -> `--shutdown-timeout-s`), exactly as
for the engine option groups. This module is plain data: it imports neither FastAPI nor torch.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from cairn.config import ConfigError, check_at_least
from cairn.server.chat.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

MIB = 1 << 20


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerOptions:
    host: str = _f("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = _f(8000, "TCP port to listen on")
    served_model_name: str | None = _f(None, "model name clients must send; default: the engine's model name "
                                             "(cairn-demo for the demo model, else the checkpoint path)")
    max_request_bytes: int = _f(32 * MIB, "largest request body accepted, in bytes; larger ones get 413")
    shutdown_timeout_s: float = _f(10.0, "on SIGTERM/SIGINT, seconds in-flight requests may run before they are "
                                         "aborted; the process then exits 0")
    access_log: bool = _f(True, "log one line per HTTP request when its response ends: client, method, path, "
                                "status, duration (/health and /metrics at DEBUG)")
    header_timeout_s: float = _f(10.0, "seconds a client may take to send a request's line and headers; then 408 "
                                       "and the connection is closed (0: no limit)")
    body_timeout_s: float = _f(60.0, "seconds a client may take to send a request body; then 408 (0: no limit)")
    body_read_mib_per_s: float = _f(128.0, "past its first 256 KiB, read a request body at most this fast (MiB/s), "
                                           "so that receiving a huge one does not slow the running streams (0: no "
                                           "limit)")
    max_connections: int = _f(1024, "open connections allowed at once; one more gets 503 and is closed, but /health "
                                    "and /ready are answered on it (0: no cap)")
    api_key: str | None = field(default=None, repr=False, metadata={  # (a secret: kept out of repr)
        "help": "require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every endpoint but /health and /ready (401 "
                "otherwise); several keys, comma-separated, are each accepted; the CAIRN_API_KEY environment variable "
                "sets it too, and keeps it out of the process list"})
    api_key_file: str | None = _f(None, "read the API key from this file (its first line; e.g. a secret a container "
                                        "mounts), which keeps it out of the process list and the shell history")
    remote_cache_file: str | None = _f(None, "read --remote-cache's Redis URL from this file (its first line), which "
                                             "keeps its password out of the process list; the CAIRN_REMOTE_CACHE "
                                             "environment variable sets it too")
    cache_isolation: str = _f("none", "per-key: each API key's requests get a prefix cache namespace of their own "
                                      "(a keyed hash of the key, with any request cache_salt inside it), so no "
                                      "key resumes, or can time, another's prompts; needs --api-key; none: only a "
                                      "request's cache_salt separates", choices=("none", "per-key"))
    metrics_public: bool = _f(False, "serve /metrics without the API key")
    allowed_origins: str | None = _f(None, "comma-separated origins browsers may call the API from (CORS), or '*'; "
                                           "default: none")
    allowed_hosts: str | None = _f(None, "comma-separated Host names a server bound to a loopback address answers "
                                         "besides localhost, 127.0.0.1, [::1] and --host (others get 421, as a DNS "
                                         "rebinding page sends), or '*' for any; default: none")
    reasoning_parser: str = _f("qwen3", "how chat answers are split into reasoning and content: qwen3 (<think> text "
                                        "becomes reasoning_content) or none (all content)", choices=REASONING_PARSERS)
    tool_call_parser: str = _f("qwen3", "how tool calls are read from chat answers: qwen3 (<tool_call> blocks, Qwen3.5 "
                                        "XML or JSON style, become tool_calls) or none (all content)",
                               choices=TOOL_CALL_PARSERS)

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65536), got {self.port}")
        check_at_least(self, {"max_request_bytes": 1, "shutdown_timeout_s": 0, "header_timeout_s": 0,
                              "body_timeout_s": 0, "body_read_mib_per_s": 0, "max_connections": 0})
        if self.api_key is not None and not self.api_keys:
            raise ConfigError("--api-key must not be empty")
        if self.cache_isolation == "per-key" and not self.api_keys:
            raise ConfigError("--cache-isolation per-key tells tenants apart by their API key: give --api-key or "
                              "--api-key-file")
        for origin in self.origins:  # what a browser sends as Origin: scheme://host[:port], no path
            if origin != "*" and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+", origin):
                raise ConfigError(f"--allowed-origins: {origin!r} is no origin a browser sends (scheme://host[:port], "
                                  f"no path or trailing slash, or '*')")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")

    @property
    def host_names(self) -> frozenset[str] | None:
        """The Host names this server answers, None for any: bound to a loopback address, its own names and
        allowed_hosts; bound to another address (0.0.0.0, a LAN address), any (it serves other machines)."""
        return loopback_host_names(self.host, self.allowed_hosts)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys (api_key, comma-separated); () without --api-key."""
        return tuple(comma_list(self.api_key))

    @property
    def origins(self) -> list[str]:
        """The allowed CORS origins, parsed from allowed_origins."""
        return comma_list(self.allowed_origins)


def loopback_host_names(host: str, allowed_hosts: str | None) -> frozenset[str] | None:
    """The Host names a server listening on `host` answers (see `ServerOptions.host_names`; `cairn router`'s too)."""
    extra = {h.lower() for h in comma_list(allowed_hosts)}
    if "*" in extra or not is_loopback(host):
        return None
    bound = f"[{host}]" if ":" in host else host.lower()
    return frozenset({"localhost", "127.0.0.1", "[::1]", bound, *extra})


def is_loopback(host: str) -> bool:
    """Whether an address to listen on is this machine's own (localhost, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def comma_list(value: str | None) -> list[str]:
    """The items of a comma-separated flag value, stripped, empty ones left out."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]
