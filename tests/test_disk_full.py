"""A disk cache on a filesystem that fills up (other files grew, or the budget exceeds the free space): a write
that meets ENOSPC makes room from the store's own least-recently-used unpinned segments and is written again,
the store keeps at most what the filesystem holds (one line) until space comes back, and a segment that cannot
fit however much is evicted fails counted, with nothing evicted for it. Never a pinned segment, never another
program's file; a read-only store evicts nothing. On a real small filesystem (a tmpfs; skipped where none can be
mounted), so the ENOSPC and the free space are the kernel's; where none can be, a simulated filesystem (the
store's writes and free-space reads replaced) shows the first behaviour."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from cairn.cache.disk import namespace as disk_namespace
from cairn.cache.disk.namespace import TEMP_NAME
from cairn.cache.disk.store import DiskStore
from tests.small_filesystem import fill, small_filesystem
from tests.test_disk_store import DIGEST, make_segment

MIB = 1 << 20
SEGMENT_KV_BYTES = 100_000  # a segment file of about 100 kB


@pytest.fixture
def fs(tmp_path) -> Path:
    with small_filesystem(tmp_path / "fs", 2 * MIB) as path:
        yield path


def segments(first: int, n: int, kv_bytes: int = SEGMENT_KV_BYTES) -> list:
    return [make_segment(first + 4 * i, kv_bytes=kv_bytes) for i in range(n)]


def files_on_disk(store: DiskStore) -> list[str]:
    return sorted(n for n in os.listdir(Path(store.root) / DIGEST) if n != ".lock")


def indexed_files(store: DiskStore) -> list[str]:
    keys = store.keys()  # a list, least recently used first (the store is not iterable)
    return sorted(f"{key.hex()}.seg" for key in keys)


def test_a_full_filesystem_makes_room_from_the_least_recently_used_segments_and_keeps_storing_new_ones(fs, caplog):
    other = fs / "other.bin"
    with caplog.at_level(logging.INFO), DiskStore(fs / "cache", DIGEST, 3 * MIB // 2) as store:
        other_bytes = fill(other, 600_000)  # another program's file grew: about 6 segments fit
        first = segments(0, 20)
        assert all(store.put(seg) for seg in first)  # every write succeeds: room is made for each
        assert store.faults["disk_full"] >= 1 and "write_failed" not in store.faults
        assert 3 <= len(store) <= 6 and store.keys() == [seg.key for seg in first[-len(store):]]  # the newest
        assert all(store.get(seg.key) == seg for seg in first[-3:])
        assert store.used_bytes <= store.effective_budget_bytes < store.budget_bytes
        assert files_on_disk(store) == indexed_files(store)  # nothing half-written is left, nothing unindexed
        assert other.stat().st_size == other_bytes  # another program's file is never touched
        store.check_integrity()
        full = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
        assert len(full) == 1 and "No space left on device" in full[0] and "less than the budget of 1.5 MiB" in full[0]

        pinned = store.keys()[0]  # the least recently used, pinned: it stays
        assert store.pin(pinned)
        assert all(store.put(seg) for seg in segments(1000, 10))
        assert store.info(pinned) is not None and len(store) >= 3
        store.unpin(pinned)
        held_when_full = len(store)

        other.unlink()  # space comes back: the store holds its whole budget again
        assert all(store.put(seg) for seg in segments(2000, 12))
        assert store.effective_budget_bytes == store.budget_bytes and len(store) > held_when_full
        assert [r for r in caplog.records if "has room again; the budget is 1.5 MiB again" in r.getMessage()]
        assert "write_failed" not in store.faults
        store.check_integrity()


def test_a_segment_a_full_filesystem_cannot_hold_fails_counted_and_evicts_nothing(fs):
    with DiskStore(fs / "cache", DIGEST, 3 * MIB // 2) as store:
        kept = segments(0, 3)
        assert all(store.put(seg) for seg in kept)
        fill(fs / "other.bin", 50_000)
        too_big = make_segment(500, kv_bytes=4 * SEGMENT_KV_BYTES)  # more than all it holds and the free space
        assert not store.put(too_big)
        assert store.faults == {"disk_full": 1, "write_failed": 1}
        assert store.keys() == [seg.key for seg in kept] and all(store.get(seg.key) == seg for seg in kept)
        assert files_on_disk(store) == indexed_files(store) and not any(TEMP_NAME.fullmatch(n) for n in
                                                                        files_on_disk(store))
        assert store.put(make_segment(600, kv_bytes=SEGMENT_KV_BYTES))  # a segment that fits makes its room
        assert store.info(kept[0].key) is None and store.get(kept[-1].key) == kept[-1]
        store.check_integrity()


def test_a_read_only_store_on_a_full_filesystem_evicts_nothing(fs):
    with DiskStore(fs / "cache", DIGEST, 3 * MIB // 2) as writer:
        kept = segments(0, 3)
        assert all(writer.put(seg) for seg in kept)
        fill(fs / "other.bin", 50_000)
        before = files_on_disk(writer)
        with DiskStore(fs / "cache", DIGEST, 3 * MIB // 2) as reader:
            assert reader.readonly and not reader.put(make_segment(600, kv_bytes=SEGMENT_KV_BYTES))
            assert reader.faults == {"readonly": 1} and sorted(reader.keys()) == sorted(writer.keys())
        assert files_on_disk(writer) == before


def test_a_simulated_full_filesystem_makes_room_and_keeps_storing_new_ones(tmp_path, monkeypatch):
    """The first test's behaviour where no tmpfs can be mounted: a filesystem of 600 kB, the namespace's files
    counted against it, a write past it failing with ENOSPC after writing part of its file."""
    capacity, namespace = 600_000, tmp_path / "cache" / DIGEST

    def used_bytes() -> int:
        return sum(os.path.getsize(namespace / n) for n in os.listdir(namespace))

    def write_all(fd, parts):
        size = sum(memoryview(p).nbytes for p in parts)
        if used_bytes() + size > capacity:
            os.write(fd, bytes(memoryview(parts[0])[:50]))
            raise OSError(errno.ENOSPC, "No space left on device")
        for part in parts:
            os.write(fd, part)

    real_fstatvfs = os.fstatvfs
    with DiskStore(tmp_path / "cache", DIGEST, 3 * MIB // 2) as store:
        monkeypatch.setattr(disk_namespace, "_write_all", write_all)
        monkeypatch.setattr(os, "fstatvfs", lambda fd: SimpleNamespace(f_frsize=1, f_bavail=capacity - used_bytes())
                            if fd == store._dir_fd else real_fstatvfs(fd))
        first = segments(0, 20)
        assert all(store.put(seg) for seg in first)
        assert store.faults["disk_full"] >= 1 and "write_failed" not in store.faults
        assert 3 <= len(store) <= 6 and store.keys() == [seg.key for seg in first[-len(store):]]
        assert store.used_bytes <= store.effective_budget_bytes <= capacity and used_bytes() <= capacity
        assert files_on_disk(store) == indexed_files(store)
        store.check_integrity()


def test_a_disk_that_stays_full_after_making_room_gives_up_after_a_bounded_number_of_writes(tmp_path, monkeypatch):
    """Another program takes every byte freed as soon as it is freed: the store writes three times (evicting one
    segment's room before each retry), then fails the put counted, and keeps the rest."""
    writes = []

    def always_full(fd, parts):
        writes.append(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    real_fstatvfs = os.fstatvfs
    with DiskStore(tmp_path / "cache", DIGEST, 3 * MIB // 2) as store:
        kept = segments(100, 10)  # all of one size, as the one refused
        assert all(store.put(seg) for seg in kept)
        monkeypatch.setattr(disk_namespace, "_write_all", always_full)
        monkeypatch.setattr(os, "fstatvfs", lambda fd: SimpleNamespace(f_frsize=1, f_bavail=0)
                            if fd == store._dir_fd else real_fstatvfs(fd))
        assert not store.put(make_segment(500, kv_bytes=SEGMENT_KV_BYTES))
        assert len(writes) == 3 and store.faults == {"disk_full": 2, "write_failed": 1}
        assert store.keys() == [seg.key for seg in kept[2:]] and store.stats()["evictions"] == 2
        assert files_on_disk(store) == indexed_files(store)
        store.check_integrity()
