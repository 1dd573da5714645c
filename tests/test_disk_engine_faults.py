"""Disk-tier faults met by a running engine (demo model, fp32, greedy, a real cache directory): an I/O error
while a conversation resumes from disk, and a snapshot whose only copy is a damaged segment while its KV is
still on the device. Each request is served as a cold run serves it, the fault is counted in the stats that
/metrics exports, and the engine's bookkeeping (pages, slots, locks) is whole afterwards.
"""

from __future__ import annotations

import errno
import os

import pytest

from cairn.cache.tree.nodes import DISK
from cairn.llm import LLM
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
    with tiered(tmp_path) as third:  # the disk healthy again: the same files resume the conversation
        out = run(third, prompt)
        assert out.cache.resume_tier == DISK and out.cache.cached_tokens > len(CONVERSATION)
        same_as_cold(cold, out, prompt)


def test_a_damaged_disk_only_snapshot_over_device_kv_falls_back_cold(tmp_path, cold):
    """Device snapshots demoted straight to disk (no host tier) while the KV stays on the device: the resume
    shares the device pages, then finds the snapshot's segment damaged; the pages are given back, the segment
    marked bad, and the request planned again."""
    with tiered(tmp_path, device_slots=3, host_slots=0) as llm:
        run(llm, CONVERSATION)
        tree = llm.engine.cache.tree
        disk_only = sorted(pos for pos, entry, node in tree.iter_snapshots()
                           if set(entry.handle.copies) == {DISK} and "device" in node.kv)
        assert disk_only and disk_only[0] < 200, disk_only
        for path in tmp_path.rglob("*.seg"):  # damaged after they were written and indexed
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        prompt = CONVERSATION[:disk_only[0] + 10] + [4, 4]
        out = run(llm, prompt)
        assert out.cache.miss_reason == "corrupt" and out.cache.resume_tier != DISK
        same_as_cold(cold, out, prompt)
        assert llm.engine.cache.stats().disk.faults.get("checksum", 0) >= 1
        llm.engine.check_integrity()  # the pages it shared and copied are back with their owners
