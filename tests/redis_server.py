"""Test helper: a real `redis-server` on a free loopback port, without persistence.

`start_redis()` starts it, waits until it answers PING and returns a `RedisServer` (url, stop(), kill(),
pause() / resume() by SIGSTOP / SIGCONT, restart_empty() on the same port); `redis_or_skip()` does the
same but skips the calling test, with the reason, when redis-server is not installed (scripts/setup installs
it). Each server runs in a temporary work dir of its own (its log, a cluster node's nodes.conf), removed once
the server has exited (stop(), kill(), or a start that failed).
Not a test module: it holds no assertions.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server_process import free_port, start_server

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


@dataclass
class RedisServer:
    proc: subprocess.Popen
    port: int
    workdir: Path
    cmd: tuple[str, ...] = ()  # how it was started

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def answers_ping(self) -> bool:
        """One PING without redis-py's retries (they back off for seconds while the server is not up yet)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:
            return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, retry=Retry(NoBackoff(), 0)).ping()
        except redis.RedisError:
            return False

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, but nothing is answered (a slow Redis)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.kill()  # kills it if SIGTERM did not end it, and removes the work dir

    def restart_empty(self, timeout_s: float = 20.0) -> None:
        """SIGKILL it and start it again on the same port, holding nothing (no persistence): what a Redis
        restarted under running replicas holds."""
        self.proc.kill()
        self.proc.wait()
        with open(self.workdir / "redis.out", "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.answers_ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start again:\n{_tail(self.log_path)}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)  # the process is gone: nothing writes there any more


def start_redis(timeout_s: float = 20.0, *args: str) -> RedisServer:
    """A redis-server started with `args` (relative paths in them are inside its work dir), once it answers
    PING; a start that fails removes the work dir and raises with the end of the server's log."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="cairn-redis-"))
    cmd = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(workdir), "--logfile", str(workdir / "redis.log"), *args]
    try:
        with open(workdir / "redis.out", "wb") as out:  # what it says before its log is open (a bad flag)
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    server = RedisServer(proc, port, workdir, tuple(cmd))
    deadline = time.monotonic() + timeout_s
    why = f"did not answer PING in {timeout_s}s"
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            why = f"exited with {server.proc.returncode}"
            break
        if server.answers_ping():
            return server
        time.sleep(0.05)
    log = _tail(workdir / "redis.out") + "\n" + _tail(server.log_path)
    server.kill()
    raise RuntimeError(f"redis-server {why}:\n{log}")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name})"


def redis_or_skip(*args: str) -> RedisServer:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (scripts/setup installs it with apt-get when it can)")
    pytest.importorskip("redis", reason="the redis Python package is not installed (pip install redis)")
    return start_redis(20.0, *args)


@contextlib.contextmanager
def replicas_on_redis(*flags: str, count: int = 2):
    """`count` real `cairn serve` replicas (with `flags`) on one real redis-server as their remote tier;
    everything is stopped on the way out. Skips where redis-server cannot run."""
    redis = redis_or_skip()
    servers = []
    try:
        servers.extend(start_server("--remote-cache", redis.url, *flags) for _ in range(count))
        yield servers
    finally:
        for server in servers:
            server.stop()
        redis.stop()


@dataclass
class RedisClusterServers:
    """Real redis-server nodes in cluster mode, joined by `redis-cli --cluster create` (no replicas)."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()  # each node's nodes.conf is in its work dir, removed with it


def cluster_or_skip(num_nodes: int = 3, timeout_s: float = 60.0) -> RedisClusterServers:
    """A Redis Cluster of num_nodes masters on free loopback ports, its slots all assigned and its state ok;
    skips the calling test when redis-server or redis-cli is not installed."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli are needed for a Redis Cluster (scripts/setup installs them)")
    pytest.importorskip("redis", reason="the redis Python package is not installed (pip install redis)")
    cluster = RedisClusterServers([])
    try:
        for _ in range(num_nodes):  # nodes.conf, relative: in the node's own work dir (redis-server's --dir)
            cluster.nodes.append(start_redis(20.0, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                             "--cluster-port", str(free_port())))  # (not port + 10000: may be > 65535)
        addresses = [f"127.0.0.1:{node.port}" for node in cluster.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while any(n.client().execute_command("CLUSTER INFO")["cluster_state"] != "ok" for n in cluster.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster
