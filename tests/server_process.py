"""Test helper: run `cairn serve` (or `cairn router`) as a real subprocess on a free loopback port.

`start_server(*flags)` starts `python -m cairn.cli serve` on the demo model with tiny pools
(`start_router(*flags)`: `cairn router`), waits until /health answers 200, and returns a
`ServerProcess`; `stop()` ends it (SIGTERM, then SIGKILL). The output goes to a temporary file (never
a pipe, which could fill and block it) and is included in the error when start-up fails; stop() removes
the file and keeps its text (`log()` still answers).

`served_fixture(*flags)` is the one fixture factory of the served test files: a module-scoped fixture
starting one server for the module and yielding a `Served` (the server plus its openai / anthropic /
httpx clients); tests/conftest.py derives the `server`, `client`, `claude` and `http` fixtures from it.
Not a test module: it holds no assertions.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import httpx
import pytest

from cairn.config import RANDOM_DEMO_NAME

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_POOLS = ("--kv-cache-gib", "0.05", "--state-cache-gib", "0.05")


# Under pytest-xdist each worker draws the ports of the servers it starts from its own slice of these, below
# the kernel's ephemeral range (32768 and up unless configured lower), whence bind(0) and clients' connections take
# theirs: a port one worker found free and closed cannot be handed to another worker (nor taken by a client's
# connection) in the seconds before its server binds it, which would start one worker's server on the other's port.
WORKER_PORTS = range(20000, 32000)
_PORT_DRAWS = random.SystemRandom()  # not the random module's state, which a test may seed


def free_port() -> int:
    """A loopback port free now, for a server started next: the kernel's pick outside pytest-xdist, else one
    in this worker's own slice of WORKER_PORTS."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    ports = WORKER_PORTS[int(worker.removeprefix("gw")) % count::count]  # interleaved: disjoint for any count
    for _ in range(1000):
        port = _PORT_DRAWS.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use here (a server of this worker, another program): draw again
                continue
            return port
    raise RuntimeError(f"no free port in {worker}'s slice of {WORKER_PORTS}")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    final_log: str | None = None  # the log's text once stop() has removed its file

    def log(self) -> str:
        if self.final_log is not None:
            return self.final_log
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
        if self.final_log is None:  # the process is gone: keep what it wrote, and leave no file behind
            self.final_log = self.log()
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode


def start_server(*flags: str, timeout_s: float = 90.0, env: dict[str, str] | None = None) -> ServerProcess:
    """`cairn serve` with tiny pools and `flags`, healthy, on the random demo model unless `flags` name a --model;
    `env` is added to the environment."""
    model = () if "--model" in flags else ("--model", RANDOM_DEMO_NAME)
    return start_cli("serve", *model, *TINY_POOLS, *flags, timeout_s=timeout_s, env=env)


def start_router(*flags: str, timeout_s: float = 60.0) -> ServerProcess:
    """`cairn router` with `flags` (its `--replica URL`s among them), once its /health answers 200 (a replica
    is up)."""
    return start_cli("router", *flags, timeout_s=timeout_s)


def start_cli(command: str, *flags: str, timeout_s: float, env: dict[str, str] | None = None) -> ServerProcess:
    """`python -m cairn.cli COMMAND --port N *flags` on a free loopback port, once its /health answers 200."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix=f"cairn-{command}-", suffix=".log")
    cmd = [sys.executable, "-m", "cairn.cli", command, "--port", str(port), *flags]
    try:
        proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    finally:
        os.close(fd)  # the child holds its own copy
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", Path(log_path))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()  # removes the log file, keeping its text
            raise RuntimeError(f"cairn {command} exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"cairn {command} did not become healthy in {timeout_s}s:\n{server.log()}")


def openai_client(server: ServerProcess, timeout_s: float = 60.0):
    """The official openai client on `server`, without retries (a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)


@dataclass
class Served:
    """One started server and the clients the tests talk to it with (each made on first use)."""

    server: ServerProcess
    client_timeout_s: float

    @cached_property
    def openai(self):
        return openai_client(self.server, self.client_timeout_s)

    @cached_property
    def anthropic(self):
        import anthropic

        return anthropic.Anthropic(base_url=self.server.base_url, api_key="unused", max_retries=0,
                                   timeout=self.client_timeout_s)

    @cached_property
    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.server.base_url, timeout=self.client_timeout_s)

    def close(self) -> None:
        if "http" in self.__dict__:
            self.http.close()
        self.server.stop()


def served_fixture(*flags: str, checkpoint: Callable[[Path], object] | None = None,
                   env: dict[str, str] | None = None, client_timeout_s: float = 60.0):
    """A module-scoped fixture serving `flags` (on the model `checkpoint(path)` writes, if given).

    Assign it to a module attribute (`served = served_fixture(...)`): that name is the fixture's.
    """

    @pytest.fixture(scope="module")
    def served(tmp_path_factory):
        model = ()
        if checkpoint is not None:
            path = tmp_path_factory.mktemp("checkpoint")
            checkpoint(path)
            model = ("--model", str(path))
        running = Served(start_server(*model, *flags, env=env), client_timeout_s)
        yield running
        running.close()

    return served
