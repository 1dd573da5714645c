"""Shared fixtures: tiny random checkpoints (one per family/layout), written once per test session."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.checkpoints import FAMILIES, write_checkpoint

# As the engine does on CPU: subnormal floats in decayed recurrent states are up to 100x slower.
torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def root_logging_as_before():
    """A test that runs `cairn.cli.main` in-process configures the root logger (`setup_logging`: its level,
    and a handler on the stderr pytest captured for that test, closed after it). Put both back, so that a
    later test neither logs into a closed file nor sees records of levels it did not ask for."""
    root, httpx_log = logging.getLogger(), logging.getLogger("httpx")
    handlers, level, httpx_level = root.handlers[:], root.level, httpx_log.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    httpx_log.setLevel(httpx_level)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{family: (path, transformers model)} for every family cairn loads."""
    made = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        made[family] = (path, write_checkpoint(family, path))
    return made


@pytest.fixture
def redis_server():
    """A real redis-server subprocess on a free port (the test is skipped where none is installed)."""
    from tests.redis_server import redis_or_skip

    server = redis_or_skip()
    yield server
    server.stop()


@pytest.fixture
def sampled_logits(monkeypatch):
    """Every logits row the engine samples from, in order (fp32 rows; use with one request at a time)."""
    import cairn.engine.engine

    rows: list[torch.Tensor] = []
    real = cairn.engine.engine.sample_isolated

    def recording(logits, params, generators, contexts=None):
        rows.extend(logits.clone())
        return real(logits, params, generators, contexts)

    monkeypatch.setattr(cairn.engine.engine, "sample_isolated", recording)
    return rows


# The served test files declare `served = served_fixture(...)` (tests/server_process.py); these are its parts.
@pytest.fixture(scope="module")
def server(served):
    """The module's `cairn serve` process (a `ServerProcess`)."""
    return served.server


@pytest.fixture(scope="module")
def client(served):
    """The official openai client on the module's server."""
    return served.openai


@pytest.fixture(scope="module")
def claude(served):
    """The official anthropic client on the module's server."""
    return served.anthropic


@pytest.fixture(scope="module")
def http(served):
    """An httpx client on the module's server."""
    return served.http
