"""ServerOptions: the frozen flags of `cairn serve` (the engine's own flags live in `cairn.config`).

`cairn.cli` turns each field into a flag (`shutdown_timeout_s` -> `--shutdown-timeout-s`), exactly as
for the engine option groups. This module is plain data: it imports neither FastAPI nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be positive")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
