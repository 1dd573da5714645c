"""Test helper: run `cairn serve` as a real subprocess on a free loopback port.

`start_server(*flags)` starts `python -m cairn.cli serve` on the demo model with tiny pools, waits
until /health answers 200, and returns a `ServerProcess`; `stop()` ends it (SIGTERM, then SIGKILL).
The server's output goes to a temporary file (never a pipe, which could fill and block it) and is
included in the error when start-up fails. Not a test module: it holds no assertions.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_POOLS = ("--kv-cache-gib", "0.05", "--state-cache-gib", "0.05")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(*flags: str, timeout_s: float = 90.0) -> ServerProcess:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="cairn-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "cairn.cli", "serve", "--port", str(port), *TINY_POOLS, *flags]
    try:
        proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        os.close(fd)  # the child holds its own copy
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", Path(log_path))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cairn serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"cairn serve did not become healthy in {timeout_s}s:\n{server.log()}")


def openai_client(server: ServerProcess, timeout_s: float = 60.0):
    """The official openai client on `server`, without retries (a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)
