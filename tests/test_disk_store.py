"""The disk segment store: put/get, restart scan, exact LRU eviction within budget, pins, the lock,
permissions, counters, the start-up warning for a budget beyond the free space, and the `cairn cache
ls|verify|purge` helpers."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cairn.cache.disk import entries as disk_entries
from cairn.cache.disk.store import (
    DiskStore,
    DiskStoreError,
    StoreLockedError,
    list_namespaces,
    purge_namespace,
    verify_store,
)
from cairn.cache.factory import build_cache
from cairn.cache.segments.named_bytes import layout_meta
from cairn.cache.segments.segment import Segment, SegmentLimits, segment_key
from cairn.config import CacheOptions
from cairn.engine.llm import LLM
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import LayerState, StateSpec, StateTensor

DIGEST = "ab" * 32
OTHER_DIGEST = "cd" * 32
CHILD = Path(__file__).with_name("disk_store_child.py")


def make_segment(i: int, parent: bytes | None = None, kv_bytes: int = 1000, snapshot: bool = True) -> Segment:
    tokens = [i, i + 1, i + 2]
    return Segment(segment_key(parent, tokens), parent, 0 if parent is None else 3, tokens, bytes([i % 256]) * kv_bytes,
                   {"i": i}, snapshot_bytes=b"s" * 100 if snapshot else None,
                   snapshot_meta=layout_meta([("state", "uint8", (100,))]) if snapshot else {})


def file_bytes(seg: Segment) -> int:
    """The size a segment takes on disk, measured by storing it once in a scratch store."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp, DiskStore(tmp, DIGEST, 1 << 30) as store:
        store.put(seg)
        return store.info(seg.key).size_bytes


def equal_sized_segments(n: int) -> list[Segment]:
    return [make_segment(10 * (i + 1)) for i in range(n)]


def start_up_line(caplog, root: Path, disk_cache_gib: float = 1.0) -> str:
    """The disk cache's INFO line of a server's start-up: build_cache over pools of a few bytes."""
    kv = KVPool(1, 8, 4, 1, 1, torch.float32)
    states = StatePool(StateSpec((LayerState(0, (StateTensor("state", (2,), torch.float32),)),)), 2)
    opts = CacheOptions(disk_cache=str(root), disk_cache_gib=disk_cache_gib, device_snapshot_gib=2**-20,
                        host_cache_gib=0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cairn.cache.factory"):
        build_cache(opts, kv, states, 6, DIGEST).close()
    (line,) = [r.getMessage() for r in caplog.records
               if r.name == "cairn.cache.factory" and r.getMessage().startswith("disk cache: ")]
    return line


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "cache"


def namespace_files(root: Path, digest: str = DIGEST) -> list[str]:
    return sorted(os.listdir(root / digest))


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
def test_put_then_get_returns_the_identical_segment(root, compression):
    with DiskStore(root, DIGEST, 1 << 20, compression=compression) as store:
        seg = make_segment(1)
        assert store.put(seg)
        assert store.info(seg.key) is not None and len(store) == 1
        assert store.get(seg.key) == seg
        info = store.info(seg.key)
        assert (info.parent_key, info.start_position, info.num_tokens, info.has_snapshot, info.has_logits) == (
            None, 0, 3, True, False)
        assert info.size_bytes == store.used_bytes == os.path.getsize(root / DIGEST / f"{seg.key.hex()}.seg")
        assert store.get(segment_key(None, [9])) is None
        assert store.stats() | {"used_bytes": 0} == {"segments": 1, "used_bytes": 0, "budget_bytes": 1 << 20,
                                                     "puts": 1, "gets": 2, "hits": 1, "evictions": 0,
                                                     "rewrites": 0, "removed": 0, "dropped": 0, "scanned": 0,
                                                     "readonly": False}
        store.check_integrity()


def test_restart_scan_indexes_what_a_previous_store_wrote(root):
    a = make_segment(1)
    b = make_segment(4, parent=a.key, snapshot=False)
    with DiskStore(root, DIGEST, 1 << 20) as store:
        assert store.put(a) and store.put(b)
        infos = {k: store.info(k) for k in (a.key, b.key)}
    with DiskStore(root, DIGEST, 1 << 20) as store:
        assert sorted(store.keys()) == sorted([a.key, b.key])
        for key, info in infos.items():
            assert store.info(key).size_bytes == info.size_bytes
            assert store.info(key).parent_key == info.parent_key
        assert store.get(a.key) == a and store.get(b.key) == b
        assert store.faults == {}
        store.check_integrity()


def test_lru_eviction_drops_least_recently_used_first_and_never_exceeds_budget(root):
    segs = equal_sized_segments(5)
    size = file_bytes(segs[0])
    evicted = []
    with DiskStore(root, DIGEST, 3 * size, on_evict=evicted.append) as store:
        for seg in segs[:3]:
            assert store.put(seg)
        assert store.get(segs[0].key) == segs[0]  # now 1 is the least recently used
        assert store.put(segs[3])
        assert evicted == [segs[1].key]
        assert store.put(segs[4])
        assert evicted == [segs[1].key, segs[2].key]
        assert store.keys() == [segs[0].key, segs[3].key, segs[4].key]
        assert store.used_bytes == 3 * size <= store.budget_bytes
        assert sorted(namespace_files(root)) == sorted([".lock"] + [f"{s.key.hex()}.seg" for s in segs[::3] + segs[4:]])
        assert store.stats()["evictions"] == 2
        store.check_integrity()


def test_restart_recency_comes_from_file_mtime(root):
    segs = equal_sized_segments(4)
    size = file_bytes(segs[0])
    with DiskStore(root, DIGEST, 3 * size) as store:
        for seg in segs[:3]:
            store.put(seg)
    for age, seg in zip((100, 300, 200), segs[:3], strict=True):  # oldest mtime: segs[1]
        os.utime(root / DIGEST / f"{seg.key.hex()}.seg", (1e9 - age, 1e9 - age))
    evicted = []
    with DiskStore(root, DIGEST, 3 * size, on_evict=evicted.append) as store:
        assert store.put(segs[3])
        assert evicted == [segs[1].key]


def test_lowered_budget_at_restart_evicts_down_to_it(root):
    segs = equal_sized_segments(3)
    size = file_bytes(segs[0])
    with DiskStore(root, DIGEST, 3 * size) as store:
        for seg in segs:
            store.put(seg)
    with DiskStore(root, DIGEST, size) as store:
        assert len(store) == 1 and store.used_bytes <= size
        store.check_integrity()


def test_a_budget_lowered_at_restart_logs_how_many_segments_and_mib_its_eviction_freed(root, caplog):
    segs = [make_segment(10 * (i + 1), kv_bytes=300_000) for i in range(3)]
    size = file_bytes(segs[0])
    with DiskStore(root, DIGEST, 3 * size) as store:
        assert all(store.put(seg) for seg in segs)
    with caplog.at_level(logging.INFO, logger="cairn.cache.disk.store"), DiskStore(root, DIGEST, size) as store:
        assert len(store) == 1
    (line,) = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert line == (f"disk cache {DIGEST[:16]}: evicted 2 segment(s), {2 * size / 2**20:.1f} MiB, to fit the budget "
                    f"of {size / 2**20:.1f} MiB")


@pytest.mark.parametrize("disk_cache_gib, shown", [(0.01, "10.2 MiB"), (0.5, "512.0 MiB"), (16, "16.0 GiB")])
def test_the_start_up_line_prints_a_budget_under_one_gib_in_mib(root, caplog, disk_cache_gib, shown):
    assert start_up_line(caplog, root, disk_cache_gib).endswith(f"/{DIGEST[:16]} ({shown} budget)")


def test_pinned_segment_is_never_evicted(root):
    segs = equal_sized_segments(4)
    size = file_bytes(segs[0])
    evicted = []
    with DiskStore(root, DIGEST, 2 * size, on_evict=evicted.append) as store:
        store.put(segs[0])
        store.put(segs[1])
        assert store.pin(segs[0].key)  # the LRU one, being read for a restore
        assert store.put(segs[2])
        assert evicted == [segs[1].key]
        assert store.pin(segs[2].key)
        assert not store.put(segs[3])  # everything left is pinned
        assert store.faults == {"budget_full": 1} and evicted == [segs[1].key]
        assert store.get(segs[0].key) == segs[0]
        store.unpin(segs[0].key)
        assert store.put(segs[3])
        assert evicted == [segs[1].key, segs[0].key]
        assert not store.pin(segs[0].key)  # gone: no pin taken
        with pytest.raises(ValueError):
            store.unpin(segs[0].key)
        store.check_integrity()


def test_segment_larger_than_the_whole_budget_is_refused_as_too_large(root):
    with DiskStore(root, DIGEST, 500) as store:
        assert not store.put(make_segment(1, kv_bytes=1000))
        assert store.faults == {"too_large": 1}
        assert namespace_files(root) == [".lock"]


def test_segment_past_the_format_limits_is_refused_as_too_large_before_any_byte_is_written(root):
    """A section larger than the segment format allows (8 GiB by default; 16 bytes here) cannot be encoded: the
    put is refused and counted as the budget's refusal is, and no file is started."""
    with DiskStore(root, DIGEST, 1 << 20, limits=SegmentLimits(max_section_bytes=16)) as store:
        assert not store.put(make_segment(1, kv_bytes=1000))
        assert store.faults == {"too_large": 1} and store.keys() == []
        assert namespace_files(root) == [".lock"]


def test_put_of_a_stored_key_rewrites_only_to_add_a_snapshot(root):
    bare, full = make_segment(1, snapshot=False), make_segment(1)
    with DiskStore(root, DIGEST, 1 << 20) as store:
        assert store.put(bare)
        assert store.put(full)
        assert store.info(full.key).has_snapshot and store.stats()["puts"] == 2
        assert store.put(bare)  # already covered: only touched
        assert store.stats()["puts"] == 2 and store.get(full.key) == full
        assert store.used_bytes == store.info(full.key).size_bytes
        store.check_integrity()


def test_the_store_counts_add_up_to_the_segments_it_indexes(root):
    """segments == scanned + puts - rewrites - evictions - removed - dropped at every step: a rewrite (a snapshot
    added to a stored key) is a put that adds no segment, an orphan removed is not a budget eviction, and a bad
    file dropped from the index and what a restart finds are counted too (an operator compared puts minus
    evictions with the segments indexed, and they drifted apart)."""
    segs = equal_sized_segments(3)
    size = file_bytes(segs[0])

    def counts(store):
        store.check_integrity()
        return {k: v for k, v in store.stats().items() if k not in ("used_bytes", "budget_bytes", "gets", "hits",
                                                                       "readonly")}

    with DiskStore(root, DIGEST, 2 * size + 200) as store:
        bare = make_segment(10, snapshot=False)  # segs[0] without its snapshot: the same key
        assert store.put(bare) and store.put(segs[0]) and store.put(segs[0])  # written, rewritten, touched
        assert counts(store) == {"segments": 1, "scanned": 0, "puts": 2, "rewrites": 1, "evictions": 0, "removed": 0,
                                 "dropped": 0}
        assert store.put(segs[1]) and store.put(segs[2])  # segs[0] leaves for the budget
        assert counts(store) == {"segments": 2, "scanned": 0, "puts": 4, "rewrites": 1, "evictions": 1, "removed": 0,
                                 "dropped": 0}
        assert store.remove_unreachable([segs[1].key]) == size  # an orphan: not an eviction
        (root / DIGEST / f"{segs[2].key.hex()}.seg").write_bytes(b"garbage")
        assert store.get(segs[2].key) is None  # a bad file: dropped
        assert counts(store) == {"segments": 0, "scanned": 0, "puts": 4, "rewrites": 1, "evictions": 1, "removed": 1,
                                 "dropped": 1}
        assert store.put(segs[0]) and store.put(segs[1])
    with DiskStore(root, DIGEST, 2 * size + 200) as store:
        assert counts(store) == {"segments": 2, "scanned": 2, "puts": 0, "rewrites": 0, "evictions": 0, "removed": 0,
                                 "dropped": 0}


def test_store_in_same_process_with_its_own_lock_description_is_readonly(root):
    seg = make_segment(1)
    with DiskStore(root, DIGEST, 1 << 20) as writer:
        writer.put(seg)
        with DiskStore(root, DIGEST, 1 << 20) as reader:
            assert reader.readonly and not writer.readonly
            assert reader.get(seg.key) == seg
            assert not reader.put(make_segment(2)) and reader.faults == {"readonly": 1}
    with DiskStore(root, DIGEST, 1 << 20) as after:  # the lock was released on close
        assert not after.readonly


def test_readonly_store_while_another_process_holds_the_lock_never_writes_evicts_or_deletes(root, caplog):
    segs = equal_sized_segments(3)
    with DiskStore(root, DIGEST, 1 << 20) as store:
        for seg in segs:
            store.put(seg)
    child = subprocess.Popen([sys.executable, str(CHILD), "hold", str(root), DIGEST], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        stray_temp = root / DIGEST / ".tmp-1-0123456789abcdef"  # maybe the holder's write in progress
        stray_temp.write_bytes(b"partial")
        broken = root / DIGEST / f"{segment_key(None, [7]).hex()}.seg"
        broken.write_bytes(b"garbage")
        before = namespace_files(root)
        with caplog.at_level(logging.WARNING), DiskStore(root, DIGEST, file_bytes(segs[0])) as reader:
            assert reader.readonly and reader.stats()["readonly"]
            assert len(reader) == 3 and reader.used_bytes > reader.budget_bytes  # over budget, yet nothing evicted
            assert all(reader.get(s.key) == s for s in segs)
            assert not reader.put(make_segment(99)) and not reader.put(make_segment(98))
            assert reader.faults["readonly"] == 2 and reader.stats()["evictions"] == 0
        assert namespace_files(root) == before
        assert sum("another process" in r.getMessage() for r in caplog.records) == 1
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    with DiskStore(root, DIGEST, 1 << 20) as writer:  # now the lock is free: cleanup happens
        assert not writer.readonly and len(writer) == 3
        assert not stray_temp.exists() and not broken.exists()


def test_namespace_and_files_are_private(tmp_path):
    old_umask = os.umask(0)
    try:
        root = tmp_path / "fresh" / "cache"
        with DiskStore(root, DIGEST, 1 << 20, create_parents=True) as store:
            store.put(seg := make_segment(1))
        mode = lambda p: stat.S_IMODE(os.lstat(p).st_mode)
        assert mode(root) == 0o700 and mode(root / DIGEST) == 0o700
        assert mode(root / DIGEST / ".lock") == 0o600
        assert mode(root / DIGEST / f"{seg.key.hex()}.seg") == 0o600
        existing = tmp_path / "shared"
        existing.mkdir(mode=0o755)
        DiskStore(existing, DIGEST, 1 << 20).close()
        assert mode(existing) == 0o755  # a root we did not create is left as it was
    finally:
        os.umask(old_umask)


def test_namespace_name_must_be_hex_and_a_real_directory(root, tmp_path):
    for bad in ("../escape", "AB" * 32, "", "abc"):
        with pytest.raises(ValueError):
            DiskStore(root, bad, 1 << 20)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root).mkdir()
    (root / OTHER_DIGEST).symlink_to(elsewhere)
    with pytest.raises(DiskStoreError):
        DiskStore(root, OTHER_DIGEST, 1 << 20)
    assert list(elsewhere.iterdir()) == []


def test_a_fault_reason_is_logged_once_an_interval_and_counted_every_time(root, caplog):
    with caplog.at_level(logging.WARNING), DiskStore(root, DIGEST, 100) as store:
        for i in range(3):
            assert not store.put(make_segment(i))
    assert store.faults == {"too_large": 3}
    assert sum("too_large" in r.getMessage() for r in caplog.records) == 1


def free_space(monkeypatch, free_bytes: int) -> None:
    """The filesystem under the store reports `free_bytes` free (shutil.disk_usage's answer)."""
    usage = shutil.disk_usage(Path.cwd())
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free_bytes))


def test_a_budget_larger_than_the_free_space_is_one_start_up_warning_and_the_store_keeps_serving(
        root, monkeypatch, caplog):
    free_space(monkeypatch, 2 * 2**20)
    with caplog.at_level(logging.WARNING), DiskStore(root, DIGEST, 16 * 2**30) as store:
        (warning,) = [r.getMessage() for r in caplog.records if "free on its filesystem" in r.getMessage()]
        assert "budget of 16.0 GiB exceeds the 2.0 MiB free" in warning and str(root) in warning
        assert "when it is full, the least recently used segments make room for new ones" in warning
        seg = make_segment(1)
        assert store.put(seg) and store.get(seg.key) == seg


def test_a_budget_the_free_space_and_the_stored_segments_cover_is_not_warned(root, monkeypatch, caplog):
    segs = equal_sized_segments(2)
    size = file_bytes(segs[0])
    with DiskStore(root, DIGEST, 2 * size) as store:
        for seg in segs:
            store.put(seg)
    free_space(monkeypatch, size)
    with caplog.at_level(logging.WARNING), DiskStore(root, DIGEST, 3 * size) as store:
        assert len(store) == 2
    assert not [r for r in caplog.records if "free on its filesystem" in r.getMessage()]


def test_list_verify_and_purge_touch_only_our_files(root):
    segs = equal_sized_segments(3)
    with DiskStore(root, DIGEST, 1 << 20) as store, DiskStore(root, OTHER_DIGEST, 1 << 20) as other:
        for seg in segs:
            store.put(seg)
        other.put(segs[0])
        sizes = [store.info(s.key).size_bytes for s in segs]
    bad_name = f"{segs[1].key.hex()}.seg"
    data = bytearray((root / DIGEST / bad_name).read_bytes())
    data[-300] ^= 0x10  # inside the kv payload
    (root / DIGEST / bad_name).write_bytes(bytes(data))
    (root / DIGEST / "notes.txt").write_text("keep me")
    (root / "not-a-namespace").mkdir()

    assert list_namespaces(root) == [(DIGEST, 3, sum(sizes), None), (OTHER_DIGEST, 1, sizes[0], None)]
    report = verify_store(root)
    assert report[DIGEST].ok == 2 and report[DIGEST].bad == [(bad_name, "checksum")]
    assert verify_store(root, OTHER_DIGEST) == {OTHER_DIGEST: (1, [])}

    with DiskStore(root, OTHER_DIGEST, 1 << 20), pytest.raises(StoreLockedError):
        purge_namespace(root, OTHER_DIGEST)
    assert namespace_files(root, OTHER_DIGEST) == [".lock", f"{segs[0].key.hex()}.seg"]
    assert purge_namespace(root, DIGEST) == 3
    assert namespace_files(root) == ["notes.txt"]  # foreign file kept, so the directory stays
    assert purge_namespace(root, OTHER_DIGEST) == 1
    assert sorted(os.listdir(root)) == [DIGEST, "not-a-namespace"]
    assert list_namespaces(tmp := root / "missing") == [] and verify_store(tmp) == {}


def test_disk_cache_creates_only_its_last_component_unless_asked(tmp_path):
    with pytest.raises(DiskStoreError, match="create-parents"):
        DiskStore(tmp_path / "missing" / "cache", DIGEST, 1 << 20)
    assert not (tmp_path / "missing").exists()
    DiskStore(tmp_path / "cache", DIGEST, 1 << 20).close()  # the last component alone is created
    DiskStore(tmp_path / "missing" / "cache", DIGEST, 1 << 20, create_parents=True).close()
    assert (tmp_path / "missing" / "cache" / DIGEST).is_dir()


def test_disk_cache_that_is_a_symlink_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(DiskStoreError, match="symbolic link"):
        DiskStore(tmp_path / "link", DIGEST, 1 << 20)
    assert list(real.iterdir()) == []


def test_disk_cache_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: os.lstat(tmp_path).st_uid + 1)  # we are someone else now
    with pytest.raises(DiskStoreError, match="belongs to uid"):
        DiskStore(tmp_path / "cache", DIGEST, 1 << 20)
    assert list((tmp_path / "cache").iterdir()) == []


def test_ls_names_the_model_of_each_namespace(root):
    DiskStore(root, DIGEST, 1 << 20, model_name="Qwen/Qwen3.5-0.8B").close()
    DiskStore(root, OTHER_DIGEST, 1 << 20).close()
    assert [(n.digest, n.model) for n in list_namespaces(root)] == [(DIGEST, "Qwen/Qwen3.5-0.8B"), (OTHER_DIGEST, None)]


def test_read_only_rescan_indexes_what_the_writer_adds_and_forgets_what_it_removes(root, monkeypatch):
    first, second = make_segment(1), make_segment(2)
    with DiskStore(root, DIGEST, 1 << 20) as writer:
        assert writer.put(first)
        gone = []
        with DiskStore(root, DIGEST, 1 << 20, on_evict=gone.append) as reader:
            assert reader.readonly and reader.info(first.key) is not None
            assert writer.put(second)
            (root / DIGEST / f"{first.key.hex()}.seg").unlink()  # as the writer's eviction would
            reads = []
            original = disk_entries.read_index_header
            monkeypatch.setattr(disk_entries, "read_index_header", lambda fd, name, *a: reads.append(name) or
                                original(fd, name, *a))
            reader.scan()
            assert reader.get(second.key) == second and reader.info(first.key) is None
            assert gone == [first.key]
            reader.scan()  # unchanged files are not read again
            assert reads == [f"{second.key.hex()}.seg"]


def test_an_unknown_compression_given_through_the_python_api_is_one_line_and_creates_nothing(tmp_path):
    """The command line offers only none, zstd and lz4; the Python API takes any string, so the store refuses an
    unknown codec before it opens its namespace."""
    with pytest.raises(ValueError, match="compression must be None, 'zstd' or 'lz4', got 'xz'"):
        LLM(kv_cache_gib=0.02, state_cache_gib=0.02, disk_cache=str(tmp_path / "cache"), disk_compression="xz")
    assert not (tmp_path / "cache").exists()
