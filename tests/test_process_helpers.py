"""The test helpers that run real subprocesses: ports apart under pytest-xdist, nothing left behind.

Under pytest-xdist each worker starts its servers on ports from its own slice (tests/server_process.py
free_port), so that two workers never start servers on one port. tests/redis_server.py gives each
redis-server a temporary work dir (its log; a cluster node's nodes.conf), tests/server_process.py each
`cairn serve` / `cairn router` a temporary log file: they must be gone once the process is stopped or
killed, and when a start fails, or every run of the suite leaves hundreds of them behind.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.redis_server import cluster_or_skip, redis_or_skip, start_redis
from tests.server_process import WORKER_PORTS, ServerProcess, free_port, start_cli


def test_xdist_workers_draw_their_servers_ports_from_disjoint_slices_below_the_ephemeral_range(monkeypatch):
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    drawn = {}
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        drawn[worker] = {free_port() for _ in range(50)}
    assert drawn["gw0"].isdisjoint(drawn["gw1"] | drawn["gw2"]) and drawn["gw1"].isdisjoint(drawn["gw2"])
    every = set().union(*drawn.values())
    assert every <= set(WORKER_PORTS) and len(every) > 100
    if ephemeral_low >= WORKER_PORTS.stop:  # as by default (32768): clients' connections never take them either
        assert max(every) < ephemeral_low
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert free_port() >= ephemeral_low  # outside xdist: the kernel's pick, as before


@pytest.fixture
def private_tmp(monkeypatch, tmp_path):
    """The temporary directory the helper makes its work dirs in, empty and this test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_redis_stopped_or_killed_leaves_no_work_dir(private_tmp, end):
    server = redis_or_skip()
    assert server.client().ping() and server.workdir.parent == private_tmp and server.log_path.exists()
    getattr(server, end)()
    assert server.proc.poll() is not None and list(private_tmp.iterdir()) == []


def test_a_redis_that_fails_to_start_leaves_no_work_dir_and_says_why(private_tmp):
    redis_or_skip().stop()  # skips where redis-server is not installed
    with pytest.raises(RuntimeError, match=r"redis-server exited with \d+:(.|\n)*no-such-directive"):
        start_redis(20.0, "--no-such-directive", "1")
    assert list(private_tmp.iterdir()) == []


def test_a_stopped_cluster_leaves_no_work_dirs_and_kept_each_nodes_conf_in_its_own(private_tmp):
    cluster = cluster_or_skip()
    assert all((node.workdir / "nodes.conf").exists() for node in cluster.nodes)
    assert len({node.workdir for node in cluster.nodes}) == len(cluster.nodes)
    cluster.stop()
    assert list(private_tmp.iterdir()) == []


def test_a_stopped_server_process_leaves_no_log_file_and_keeps_its_text(private_tmp):
    fd, log_path = tempfile.mkstemp(suffix=".log")
    with open(fd, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "print('served')"], stdout=out)
    proc.wait()  # it has said what it says: stop() finds it ended
    server = ServerProcess(proc, "http://127.0.0.1:1", Path(log_path))
    assert server.stop() == 0
    assert list(private_tmp.iterdir()) == [] and server.log() == "served\n"


def test_a_refused_server_start_leaves_no_log_file_and_says_why(private_tmp):
    with pytest.raises(RuntimeError, match="cairn serve exited with 2:(.|\n)*max-num-seqs"):
        start_cli("serve", "--max-num-seqs", "0", timeout_s=60)
    assert list(private_tmp.iterdir()) == []
