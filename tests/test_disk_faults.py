"""Damaged, hostile or interrupted disk-cache files: each is never loaded, is counted under its reason,
the store keeps serving its other segments, and nothing outside the namespace is touched."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cairn.cache.disk import faults as disk_faults
from cairn.cache.disk import namespace as disk_namespace
from cairn.cache.disk.faults import LOG_INTERVAL_S
from cairn.cache.disk.namespace import TEMP_NAME
from cairn.cache.disk.store import DiskStore, verify_store
from cairn.cache.segments.named_bytes import layout_meta
from cairn.cache.segments.segment import (
    DEFAULT_LIMITS,
    FORMAT_VERSION,
    HEADER_BYTES,
    SECTION_HEADER_BYTES,
    Segment,
    segment_key,
)
from tests.test_segment import reseal

DIGEST = "ab" * 32
OTHER_DIGEST = "cd" * 32
BUDGET_BYTES = 1 << 20
CHILD = Path(__file__).with_name("disk_store_child.py")


def make_segment(first_token: int, snapshot: bool = True, logits: bool = True) -> Segment:
    tokens = list(range(first_token, first_token + 8))
    return Segment(segment_key(None, tokens), None, 0, tokens, b"K" * 2000, {"pages": [1, 2]},
                   snapshot_bytes=b"S" * 1000 if snapshot else None,
                   snapshot_meta=layout_meta([("state", "uint8", (1000,))]) if snapshot else {},
                   logits_bytes=b"L" * 500 if logits else None, logits_meta={"vocab": 125})


@dataclass
class Env:
    root: Path  # the store root
    namespace: Path  # root / DIGEST
    outside: Path  # a directory next to the root that must never be touched
    victim: Segment  # the segment whose file each test damages
    other: Segment  # a healthy segment the store must keep serving

    @property
    def victim_path(self) -> Path:
        return self.namespace / f"{self.victim.key.hex()}.seg"


def tree_state(path: Path) -> dict:
    """Everything observable about a directory tree, links included (never followed)."""
    state = {}
    for p in sorted(path.rglob("*")):
        st = os.lstat(p)
        body = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
        state[str(p.relative_to(path))] = (st.st_mode, st.st_size, st.st_mtime_ns, body)
    return state


@pytest.fixture
def env(tmp_path) -> Env:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not yours")
    e = Env(tmp_path / "cache", tmp_path / "cache" / DIGEST, outside, make_segment(100), make_segment(200))
    with DiskStore(e.root, DIGEST, BUDGET_BYTES) as store:
        assert store.put(e.victim) and store.put(e.other)
    shutil.copy(e.victim_path, outside / "victim.seg")  # a valid segment living elsewhere
    e.outside_state = tree_state(outside)
    return e


def assert_never_loaded(env: Env, reason: str, store: DiskStore | None = None, count: int = 1) -> None:
    """The damaged victim is a counted miss; the other segment and new puts still work; outside untouched."""
    store = store or DiskStore(env.root, DIGEST, BUDGET_BYTES)
    with store:
        assert store.get(env.victim.key) is None
        assert store.info(env.victim.key) is None
        assert store.faults.get(reason) == count, store.faults
        assert store.get(env.other.key) == env.other
        fresh = make_segment(300)
        assert store.put(fresh) and store.get(fresh.key) == fresh
        store.check_integrity()
    assert tree_state(env.outside) == env.outside_state


def sections(data: bytes) -> dict[str, int]:
    """Offset of a byte inside each part of a segment file (the middle of each section's payload)."""
    offsets, offset = {"header": 144}, HEADER_BYTES
    for name in ("tokens", "kv", "snapshot", "logits", "meta"):
        stored = struct.unpack_from("<IQQ", data, offset)[1]
        offsets[name] = offset + SECTION_HEADER_BYTES + stored // 2
        offset += SECTION_HEADER_BYTES + stored
    offsets["end_magic"], offsets["end_digest"] = len(data) - 30, len(data) - 5
    return offsets


def test_truncated_file_is_never_loaded(env):
    os.truncate(env.victim_path, env.victim_path.stat().st_size // 2)
    assert_never_loaded(env, "truncated")
    assert not env.victim_path.exists()  # our own bad file is removed


def test_a_file_truncated_under_the_start_up_scan_is_never_loaded(env, monkeypatch, caplog):
    """The file is cut short (another process truncating it, a disk filling up under a copy) after the scan read
    its header, whose size matched, and before it reads the end marker: the marker comes back short."""
    real_pread, victim = os.pread, str(env.victim_path)

    def header_then_truncate(fd, size, offset):
        data = real_pread(fd, size, offset)
        if offset == 0 and os.readlink(f"/proc/self/fd/{fd}") == victim:
            monkeypatch.setattr(os, "pread", real_pread)  # once
            os.truncate(victim, env.victim_path.stat().st_size - 10)
        return data

    monkeypatch.setattr(os, "pread", header_then_truncate)
    store = DiskStore(env.root, DIGEST, BUDGET_BYTES)
    assert os.pread is real_pread  # the scan did read the victim's header
    assert "no end marker" in caplog.text  # (the fault's one log line): the marker read short, not the header
    assert_never_loaded(env, "truncated", store)
    assert not env.victim_path.exists()  # our own bad file is removed


def fault_lines(caplog, reason: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f": {reason}: " in r.getMessage()]


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The fault log's clock, stepped by the test: clock[0] += LOG_INTERVAL_S passes the interval."""
    now_s = [1000.0]
    monkeypatch.setattr(disk_faults, "monotonic", lambda: now_s[0])
    return now_s


def test_a_fault_on_every_read_logs_one_line_per_interval_and_then_how_many_it_did_not(env, clock, caplog):
    """The namespace's files deleted under a running store: every read is a "missing" fault. The first is logged,
    the next ones within the interval are only counted, the first one after it is logged with their number."""
    segments = [make_segment(1000 + 10 * i) for i in range(21)]
    with caplog.at_level(logging.WARNING), DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert all(store.put(s) for s in segments)
        for s in segments:
            (env.namespace / f"{s.key.hex()}.seg").unlink()
        assert all(store.get(s.key) is None for s in segments[:20])
        assert len(fault_lines(caplog, "missing")) == 1
        clock[0] += LOG_INTERVAL_S
        assert store.get(segments[20].key) is None
        assert store.faults == {"missing": 21}
    first, second = fault_lines(caplog, "missing")
    assert f"{segments[0].key.hex()}.seg" in first and f"{segments[20].key.hex()}.seg" in second
    assert "and 19 more missing since the last line 60 s ago (counted, not logged)" in second


def test_a_reason_logged_at_start_up_is_logged_again_when_it_recurs_while_serving(env, clock, caplog):
    os.truncate(env.victim_path, env.victim_path.stat().st_size // 2)
    with caplog.at_level(logging.WARNING), DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert store.faults == {"truncated": 1}
        other_path = env.namespace / f"{env.other.key.hex()}.seg"
        os.truncate(other_path, other_path.stat().st_size - 10)  # found by the read that serves it, an hour later
        clock[0] += 3600
        assert store.get(env.other.key) is None and store.faults == {"truncated": 2}
    lines = fault_lines(caplog, "truncated")
    assert len(lines) == 2 and env.victim_path.name in lines[0] and other_path.name in lines[1]


@pytest.mark.parametrize("damage", ["bit_flip", "another_segment_under_its_name"])
def test_a_file_found_bad_while_serving_is_named_in_its_fault_line(env, caplog, damage):
    other_path = env.namespace / f"{env.other.key.hex()}.seg"
    with caplog.at_level(logging.WARNING), DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        if damage == "bit_flip":
            data = bytearray(other_path.read_bytes())
            data[sections(data)["kv"]] ^= 0x04
            other_path.write_bytes(bytes(data))
        else:
            shutil.copy(env.victim_path, other_path)  # valid, but its key is the victim's
        assert store.get(env.other.key) is None
    reason = "checksum" if damage == "bit_flip" else "malformed"
    [line] = fault_lines(caplog, reason)
    assert other_path.name in line, line
    assert ("checksum mismatch" if damage == "bit_flip" else "the key differs from the file name") in line


@pytest.mark.parametrize("part, reason", [("header", "checksum"), ("tokens", "checksum"), ("kv", "checksum"),
                                          ("snapshot", "checksum"), ("logits", "checksum"), ("meta", "checksum"),
                                          ("end_magic", "malformed"), ("end_digest", "checksum")])
def test_bit_flip_in_each_part_is_never_loaded(env, part, reason):
    data = bytearray(env.victim_path.read_bytes())
    data[sections(data)[part]] ^= 0x04
    env.victim_path.write_bytes(bytes(data))
    assert_never_loaded(env, reason)
    assert not env.victim_path.exists()


def test_wrong_format_version_is_never_loaded(env):
    data = env.victim_path.read_bytes()
    env.victim_path.write_bytes(reseal(data[:8] + struct.pack("<H", FORMAT_VERSION + 1) + data[10:]))
    assert_never_loaded(env, "version")


def test_valid_segment_of_another_model_copied_in_is_never_loaded(env):
    with DiskStore(env.root, OTHER_DIGEST, BUDGET_BYTES) as other_model:
        assert other_model.put(env.victim)
    foreign = env.root / OTHER_DIGEST / env.victim_path.name
    shutil.copy(foreign, env.victim_path)
    before = foreign.read_bytes()
    assert_never_loaded(env, "foreign_model")
    assert foreign.read_bytes() == before  # the other namespace is untouched
    with DiskStore(env.root, OTHER_DIGEST, BUDGET_BYTES) as other_model:
        assert other_model.get(env.victim.key) == env.victim


def test_zero_length_file_is_never_loaded(env):
    os.truncate(env.victim_path, 0)
    assert_never_loaded(env, "empty")


def test_oversized_sparse_file_is_refused_without_reading_it(env):
    os.truncate(env.victim_path, DEFAULT_LIMITS.max_file_bytes + 1)
    t0 = time.monotonic()
    assert_never_loaded(env, "oversized")
    assert time.monotonic() - t0 < 5
    assert not env.victim_path.exists()


@pytest.mark.parametrize("target", ["valid_segment_elsewhere", "file_outside"])
@pytest.mark.parametrize("when", ["before_scan", "after_scan"])
def test_segment_replaced_by_a_symlink_is_never_followed_nor_deleted_but_moved_aside(env, target, when):
    link_target = env.outside / ("victim.seg" if target == "valid_segment_elsewhere" else "secret.txt")
    store = DiskStore(env.root, DIGEST, BUDGET_BYTES) if when == "after_scan" else None
    env.victim_path.unlink()
    env.victim_path.symlink_to(link_target)
    temp_link = env.namespace / ".tmp-1-0123456789abcdef"  # a link with our temp name is not ours either
    temp_link.symlink_to(env.outside / "secret.txt")
    store = store or DiskStore(env.root, DIGEST, BUDGET_BYTES)
    with store:
        assert store.get(env.victim.key) is None
        assert store.faults.get("symlink") == 1, store.faults
        assert store.get(env.other.key) == env.other
        assert store.put(env.victim) and store.get(env.victim.key) == env.victim  # a real file now
        store.check_integrity()
    quarantined = env.namespace / "quarantine" / env.victim_path.name
    assert quarantined.is_symlink() and os.readlink(quarantined) == str(link_target)
    assert temp_link.is_symlink()
    assert tree_state(env.outside) == env.outside_state
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as again:  # not met again at the next start
        assert again.faults == {} and again.get(env.victim.key) == env.victim


def test_read_only_store_skips_the_links_it_rejected_when_it_rescans(env):
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as writer:  # holds the lock: the next one is read-only
        env.victim_path.unlink()
        env.victim_path.symlink_to(env.outside / "victim.seg")
        with DiskStore(env.root, DIGEST, BUDGET_BYTES) as reader:
            assert reader.readonly and reader.get(env.victim.key) is None
            reader.scan()
            assert reader.info(env.victim.key) is None and reader.faults == {"symlink": 1}
            assert env.victim_path.is_symlink()  # a read-only store moves nothing
        assert writer.get(env.other.key) == env.other


def test_non_regular_files_with_segment_names_are_skipped_without_blocking(env):
    env.victim_path.unlink()
    os.mkfifo(env.victim_path)  # opening a FIFO for reading would block without O_NONBLOCK
    (env.namespace / f"{segment_key(None, [1]).hex()}.seg").mkdir()
    (env.namespace / "README").write_text("someone else's")
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert store.faults == {"not_regular": 2, "foreign_name": 1}
    assert_never_loaded(env, "not_regular", count=None)  # moved aside: not met again
    assert (env.namespace / "quarantine" / env.victim_path.name).exists() and not env.victim_path.exists()
    assert (env.namespace / "README").read_text() == "someone else's"


def test_disk_full_during_a_write_loses_nothing_else(env, monkeypatch, caplog):
    def full_disk(fd, parts):
        os.write(fd, bytes(memoryview(parts[0])[:50]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        used = store.used_bytes
        monkeypatch.setattr(disk_namespace, "_write_all", full_disk)
        assert not store.put(make_segment(300))
        assert not store.put(make_segment(400))
        assert store.faults == {"write_failed": 2}
        assert sum("write_failed" in r.getMessage() for r in caplog.records) == 1
        assert store.used_bytes == used and len(store) == 2
        assert not any(TEMP_NAME.fullmatch(n) for n in os.listdir(env.namespace))
        monkeypatch.undo()
        assert store.get(env.victim.key) == env.victim and store.get(env.other.key) == env.other
        assert store.put(make_segment(300))
        store.check_integrity()


def test_real_file_size_limit_efbig_fails_the_put_cleanly(tmp_path):
    out = subprocess.run([sys.executable, str(CHILD), "efbig", str(tmp_path / "cache"), DIGEST],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["small_put"] and not report["big_put"] and report["small_get_ok"] and not report["big_indexed"]
    assert report["faults"] == {"write_failed": 1}
    assert [n for n in report["files"] if n != ".lock"] == [n for n in report["files"] if n.endswith(".seg")]
    assert len(report["files"]) == 2  # the lock and the small segment: no temp file left
    assert report["used_bytes"] == os.path.getsize(tmp_path / "cache" / DIGEST / report["files"][1])


def test_writer_killed_at_random_times_leaves_only_complete_verified_segments(tmp_path):
    root, rng = tmp_path / "cache", random.Random(20240601)
    namespace, kills_during_write, num_trials = root / DIGEST, 0, 30
    for trial in range(num_trials):
        child = subprocess.Popen([sys.executable, str(CHILD), "write_loop", str(root), DIGEST, str(trial)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.04))
        child.kill()
        child.wait(timeout=10)
        child.stdout.close()
        kills_during_write += any(TEMP_NAME.fullmatch(n) for n in os.listdir(namespace))
        with DiskStore(root, DIGEST, budget_bytes=3 << 20) as store:
            assert not any(TEMP_NAME.fullmatch(n) for n in os.listdir(namespace))
            assert set(store.faults) <= {"stale_temp"}, store.faults
            keys = store.keys()
            assert all(store.get(key).key == key for key in keys)
            store.check_integrity()
        assert verify_store(root, DIGEST)[DIGEST].bad == []
    assert kills_during_write >= 1  # the test did exercise interrupted writes
