"""The disk store when the operating system fails it: a lock file that is not a file, a namespace other users
can read, a quarantine that cannot take a bad entry, a file removed by another process between the listing
and the read, an I/O error on a read, a directory fsync that fails. Each is made by the environment (a FIFO,
a mode, a file where a directory should be, a real unlink) or, where nothing else can make it on a healthy
disk (EIO, a failing fsync), injected at the one OS call that fails; each ends as a counted fault or a
one-line error, and the store keeps serving its other segments.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket

import pytest

from cairn.cache.disk.namespace import DiskStoreError
from cairn.cache.disk.store import DiskStore
from tests import test_disk_faults
from tests.test_disk_faults import BUDGET_BYTES, DIGEST, Env, make_segment
from tests.test_disk_store import start_up_line


@pytest.fixture
def env(tmp_path) -> Env:
    """test_disk_faults' store: a victim segment and another, next to a directory that must stay untouched."""
    return test_disk_faults.env.__wrapped__(tmp_path)


def test_a_lock_that_is_not_a_regular_file_leaves_the_store_read_only_with_the_fault_counted(env):
    (env.namespace / ".lock").unlink()  # the previous store's lock file, replaced
    os.mkfifo(env.namespace / ".lock")  # opening a FIFO read-write does not block: fstat finds it
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert store.readonly and store.faults == {"lock_failed": 1}
        assert store.get(env.victim.key) == env.victim and store.get(env.other.key) == env.other
        assert not store.put(make_segment(300))  # a store without the lock never writes
        assert store.faults == {"lock_failed": 1, "readonly": 1}
    assert sorted(os.listdir(env.namespace)) == sorted([".lock", env.victim_path.name, f"{env.other.key.hex()}.seg"])


def test_a_lock_name_taken_by_a_directory_leaves_the_store_read_only(env):
    (env.namespace / ".lock").unlink()
    (env.namespace / ".lock").mkdir()  # os.open(O_RDWR | O_CREAT) fails with EISDIR
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert store.readonly and store.faults == {"lock_failed": 1}
        assert store.get(env.other.key) == env.other


@pytest.mark.parametrize("cause", ["held_by_another_store", "lock_is_a_fifo"])
def test_a_read_only_store_says_why_it_is_read_only(env, caplog, cause):
    """Another process holding the lock, or a lock that cannot be taken (a FIFO here; a read-only filesystem's
    EROFS reads the same): every line says which, and none blames another process for a lock nobody holds."""
    holder = DiskStore(env.root, DIGEST, BUDGET_BYTES) if cause == "held_by_another_store" else None
    if holder is None:
        (env.namespace / ".lock").unlink()
        os.mkfifo(env.namespace / ".lock")
    why = "another process holds its lock" if holder else "its lock could not be taken: [Errno 22] lock is not a " \
                                                          "regular file"
    try:
        with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
            assert store.readonly and store.readonly_reason == why
            assert not store.put(make_segment(300)) and store.faults.get("readonly") == 1
        line = start_up_line(caplog, env.root)  # a server's start-up: its store's warning, then this line
    finally:
        if holder is not None:
            holder.close()
    assert line.endswith(f"; read-only: {why})"), line
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("cairn")]
    assert "read-only" in warning and ("another process holds its lock" in warning) == (holder is not None)


def test_a_namespace_other_users_can_read_is_used_with_one_warning(env, caplog):
    env.namespace.chmod(0o755)
    with caplog.at_level(logging.WARNING), DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert store.get(env.other.key) == env.other
    assert sum("accessible to other users" in r.getMessage() for r in caplog.records) == 1


def test_a_disk_cache_path_that_is_a_file_is_refused_with_one_line(tmp_path):
    path = tmp_path / "cache"
    path.write_text("not a directory")
    with pytest.raises(DiskStoreError, match="is not a directory"):
        DiskStore(path, DIGEST, BUDGET_BYTES)
    assert path.read_text() == "not a directory"


@pytest.mark.parametrize("blocker", ["quarantine_is_a_file", "quarantined_name_is_a_directory"])
def test_a_link_the_quarantine_cannot_take_is_counted_left_in_place_and_never_followed(env, blocker):
    env.victim_path.unlink()
    env.victim_path.symlink_to(env.outside / "secret.txt")
    if blocker == "quarantine_is_a_file":
        (env.namespace / "quarantine").write_text("someone's file")  # mkdir finds it, O_DIRECTORY refuses it
    else:
        (env.namespace / "quarantine" / env.victim_path.name / "inside").mkdir(parents=True)  # rename: EISDIR
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert store.faults == {"symlink": 1, "quarantine_failed": 1}
        assert store.get(env.victim.key) is None and store.get(env.other.key) == env.other
        assert store.put(make_segment(300))
        store.check_integrity()
    assert env.victim_path.is_symlink() and (env.outside / "secret.txt").read_text() == "not yours"


def test_a_segment_removed_by_another_process_during_a_rescan_leaves_the_index_quietly(env, monkeypatch):
    """The listing names a file that another process deletes before the store reads it (the race that a
    purge or the writer's eviction makes with a read-only store's rescan)."""
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as writer, DiskStore(env.root, DIGEST, BUDGET_BYTES) as reader:
        assert reader.readonly and set(reader.keys()) == {env.victim.key, env.other.key}
        evicted = []
        reader.on_evict = evicted.append
        listdir = os.listdir

        def listing_then_removal(fd):
            names = listdir(fd)
            env.victim_path.unlink()  # the writer's eviction, between our listing and our read
            return names

        monkeypatch.setattr(os, "listdir", listing_then_removal)
        reader.scan()
        monkeypatch.undo()
        assert reader.keys() == [env.other.key] and evicted == [env.victim.key]
        assert reader.faults == {} and reader.get(env.other.key) == env.other
        reader.check_integrity()
        assert writer.get(env.other.key) == env.other


def test_a_rejected_link_removed_during_a_rescan_is_skipped_quietly(env, monkeypatch):
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as writer:
        env.victim_path.unlink()
        env.victim_path.symlink_to(env.outside / "secret.txt")
        with DiskStore(env.root, DIGEST, BUDGET_BYTES) as reader:
            assert reader.readonly and reader.faults == {"symlink": 1}  # remembered: not read again
            listdir = os.listdir

            def listing_then_removal(fd):
                names = listdir(fd)
                env.victim_path.unlink()
                return names

            monkeypatch.setattr(os, "listdir", listing_then_removal)
            reader.scan()
            monkeypatch.undo()
            assert reader.keys() == [env.other.key] and reader.faults == {"symlink": 1}
        assert writer.get(env.other.key) == env.other


def failing(real, fail_when, err: int):
    """`real`, raising OSError(err) on the calls for which fail_when(*args) is true."""
    def call(*args, **kwargs):
        if fail_when(*args):
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)
    return call


def test_an_io_error_reading_a_segment_is_a_counted_miss_and_the_file_is_kept(env, monkeypatch):
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        monkeypatch.setattr(os, "readv", failing(os.readv, lambda fd, bufs: True, errno.EIO))
        assert store.get(env.victim.key) is None
        monkeypatch.undo()
        assert store.faults == {"read_failed": 1} and store.info(env.victim.key) is None
        assert store.get(env.other.key) == env.other
        assert env.victim_path.exists()  # an I/O error is not proof of damage: the file stays
        store.check_integrity()


def test_an_io_error_reading_a_header_at_start_up_skips_that_segment(env, monkeypatch):
    def is_victim(fd, *_):
        return os.readlink(f"/proc/self/fd/{fd}") == str(env.victim_path)

    monkeypatch.setattr(os, "pread", failing(os.pread, is_victim, errno.EIO))
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        monkeypatch.undo()
        assert store.faults == {"read_failed": 1} and store.keys() == [env.other.key]
        assert store.get(env.other.key) == env.other
        store.scan()  # the disk is healthy again: the next scan indexes it
        assert set(store.keys()) == {env.victim.key, env.other.key}
        assert store.get(env.victim.key) == env.victim


def test_an_io_error_listing_the_namespace_at_start_up_fails_the_store_and_releases_its_lock(env, monkeypatch):
    """The start-up scan cannot list the directory (EIO on the namespace's fd): the store is refused with the OS
    error, and what it had opened (the directory, the namespace lock) is let go, so a later store takes the lock
    and serves the files."""
    monkeypatch.setattr(os, "listdir", failing(os.listdir, lambda path: isinstance(path, int), errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        DiskStore(env.root, DIGEST, BUDGET_BYTES)
    monkeypatch.undo()
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert not store.readonly and store.get(env.other.key) == env.other


def test_a_failing_directory_fsync_keeps_the_written_segment_and_counts_it(env, monkeypatch):
    with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        dir_fd = store._dir_fd
        monkeypatch.setattr(os, "fsync", failing(os.fsync, lambda fd: fd == dir_fd, errno.EIO))
        fresh = make_segment(300)
        assert store.put(fresh)  # complete and visible; only its name's durability is in doubt
        monkeypatch.undo()
        assert store.faults == {"dir_sync_failed": 1} and store.get(fresh.key) == fresh
        store.check_integrity()


def test_a_socket_named_like_a_segment_is_moved_aside_never_read(env, monkeypatch):
    env.victim_path.unlink()
    listener = socket.socket(socket.AF_UNIX)
    monkeypatch.chdir(env.namespace)  # a socket's path must be short: bind its bare name
    listener.bind(env.victim_path.name)  # opening a socket fails with ENXIO
    try:
        with DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
            assert store.faults == {"not_regular": 1} and store.get(env.other.key) == env.other
    finally:
        listener.close()
    assert (env.namespace / "quarantine" / env.victim_path.name).exists() and not env.victim_path.exists()


@pytest.mark.parametrize("when", ["before_scan", "after_scan"])
def test_a_valid_segment_under_another_segments_name_is_refused_and_deleted(env, when):
    other_path = env.namespace / f"{env.other.key.hex()}.seg"
    store = DiskStore(env.root, DIGEST, BUDGET_BYTES) if when == "after_scan" else None
    shutil.copy(other_path, env.victim_path)  # a whole, checksummed segment: only its name is wrong
    with store or DiskStore(env.root, DIGEST, BUDGET_BYTES) as store:
        assert store.get(env.victim.key) is None and store.faults == {"malformed": 1}
        assert store.get(env.other.key) == env.other
    assert not env.victim_path.exists() and other_path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_namespace_owned_by_another_user_is_refused_with_one_line(env):
    os.chown(env.namespace, os.geteuid() + 4242, -1)  # the root is ours, the namespace in it is not
    with pytest.raises(DiskStoreError, match="belongs to uid"):
        DiskStore(env.root, DIGEST, BUDGET_BYTES)
    assert len(list(env.namespace.glob("*.seg"))) == 2  # nothing touched


@pytest.mark.parametrize("missing", ["the directory", "this model's namespace"])
def test_a_disk_cache_on_a_read_only_filesystem_lacking_what_it_needs_is_refused_with_one_line(tmp_path, monkeypatch,
                                                                                               missing):
    """A cache directory on a read-only filesystem (EROFS, injected at mkdir: nothing else makes one without
    root): missing, or holding other models' namespaces only, it is a one-line DiskStoreError, never an
    OSError's traceback; its other namespaces are untouched."""
    root = tmp_path / "cache"
    if missing == "this model's namespace":
        with DiskStore(root, "ef" * 32, BUDGET_BYTES) as other:  # another model's namespace, filled
            assert other.put(make_segment(300))

    def read_only(path, mode=0o777, *, dir_fd=None):  # as Linux answers: EEXIST first, then EROFS
        if os.path.lexists(path if dir_fd is None else f"/proc/self/fd/{dir_fd}/{path}"):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(os, "mkdir", read_only)
    why = "does not exist and cannot be created" if missing == "the directory" else "holds no namespace"
    with pytest.raises(DiskStoreError, match=f"{why}.*Read-only file system"):
        DiskStore(root, DIGEST, BUDGET_BYTES)
    monkeypatch.undo()
    assert (not root.exists()) if missing == "the directory" else [p.name for p in root.iterdir()] == ["ef" * 32]
