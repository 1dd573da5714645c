"""An I/O error met by a running engine (demo model, fp32, greedy, a real cache directory) while a conversation
resumes from disk after a restart: the request is served as a cold run serves it, the fault is counted in the
stats that /metrics exports (`read_failed`), the engine's bookkeeping (pages, slots, locks) is whole
afterwards, and the files stay (an I/O error is no proof of damage; tests/test_disk_os_faults.py shows the
store indexing such a file again once the disk reads). EIO is injected at `os.readv`, the one call that
reads a segment's bytes: nothing else makes a healthy disk fail a read.
"""

from __future__ import annotations

import errno
import os

import pytest

from cairn.engine.llm import LLM
from tests.harness import run, same_as_cold
from tests.test_disk_os_faults import failing
from tests.test_tiers import CONVERSATION, OPTS, tiered


@pytest.fixture(scope="module")
def cold():
    return LLM(**OPTS, prefix_cache=False)


def test_an_io_error_while_resuming_from_disk_serves_the_cold_output_and_keeps_the_files(tmp_path, cold, monkeypatch):
    with tiered(tmp_path) as first:
        reply = run(first, CONVERSATION)
    prompt = CONVERSATION + reply.token_ids + [5, 6]
    with tiered(tmp_path) as second:
        files = sorted(p.name for p in tmp_path.rglob("*.seg"))
        monkeypatch.setattr(os, "readv", failing(os.readv, lambda fd, bufs: True, errno.EIO))  # the disk fails
        out = run(second, prompt)
        monkeypatch.undo()
        assert out.cache.cached_tokens == 0 and out.cache.miss_reason == "corrupt"
        same_as_cold(cold, out, prompt)
        assert second.engine.cache.stats().disk.faults.get("read_failed", 0) >= 1
        assert set(files) <= {p.name for p in tmp_path.rglob("*.seg")}  # an I/O error is no proof of damage

