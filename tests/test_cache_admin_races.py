"""`cairn cache ls | verify | purge` while the directory changes under it: a namespace another purge removes
between the listing and the opening, the whole cache directory removed after the command checked it, a
segment a running server evicts between the listing and the read, and a read that fails with an I/O error.
Each command finishes with what it could read (a removed namespace or file is not an error; an unreadable
file is a bad one, exit 1), in-process through `cairn.cli.main` on a real directory. The removals are real
(`shutil.rmtree`, `unlink`), made right after the real listing; only EIO, which a healthy disk cannot
produce, is injected at `os.readv`.
"""

from __future__ import annotations

import errno
import os
import shutil

from tests.test_cache_admin import DIGEST, cache_command, filled
from tests.test_disk_os_faults import failing

OTHER = "cd" * 32


def removing_after_listing(monkeypatch, remove) -> None:
    """Make the next os.listdir list the directory as it is, then run remove() (another process's change)."""
    real = os.listdir

    def listing_then_change(*args, **kwargs):
        listed = real(*args, **kwargs)
        monkeypatch.setattr(os, "listdir", real)  # once
        remove()
        return listed

    monkeypatch.setattr(os, "listdir", listing_then_change)


class _Entries(list):
    """os.scandir's result as a list that is also its context manager."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def removing_after_scan(monkeypatch, remove) -> None:
    """Make the next os.scandir list the directory as it is, then run remove() (another process's change)."""
    real = os.scandir

    def scan_then_change(path):
        with real(path) as entries:
            listed = _Entries(entries)
        monkeypatch.setattr(os, "scandir", real)  # once (rmtree scans too)
        remove()
        return listed

    monkeypatch.setattr(os, "scandir", scan_then_change)


def test_ls_skips_a_namespace_removed_between_the_listing_and_the_opening(tmp_path, capsys, monkeypatch):
    filled(tmp_path, DIGEST)
    filled(tmp_path, OTHER, num_segments=1)
    removing_after_scan(monkeypatch, lambda: shutil.rmtree(tmp_path / OTHER))  # another `cairn cache purge` first
    status, out, _ = cache_command(capsys, "ls", "--disk-cache", str(tmp_path))
    assert status == 0 and DIGEST[:16] in out and OTHER[:16] not in out and "1 namespace(s)" in out


def test_verify_and_purge_of_a_namespace_removed_after_it_was_named_find_nothing(tmp_path, capsys, monkeypatch):
    for action, expected in (("verify", f"no disk cache namespace in {tmp_path}"), ("purge", "removed 0 segment")):
        filled(tmp_path, DIGEST)
        removing_after_scan(monkeypatch, lambda: shutil.rmtree(tmp_path / DIGEST))  # once --namespace was resolved
        status, out, _ = cache_command(capsys, action, "--disk-cache", str(tmp_path), "--namespace", DIGEST[:16])
        assert status == 0 and expected in out, (action, out)


def test_verify_skips_a_segment_evicted_during_it_and_reports_an_unreadable_one(tmp_path, capsys, monkeypatch):
    filled(tmp_path, DIGEST, num_segments=3)
    files = sorted((tmp_path / DIGEST).glob("*.seg"))
    removing_after_listing(monkeypatch, files[0].unlink)  # a server's eviction
    unreadable = str(files[1])
    is_unreadable = lambda fd, bufs: os.readlink(f"/proc/self/fd/{fd}") == unreadable  # noqa: E731
    monkeypatch.setattr(os, "readv", failing(os.readv, is_unreadable, errno.EIO))
    status, out, _ = cache_command(capsys, "verify", "--disk-cache", str(tmp_path))
    assert status == 1
    assert out.splitlines() == [f"{DIGEST[:16]}: 1 ok, 1 bad", f"  {files[1].name}: read_failed"]
    assert files[1].exists() and files[2].exists()  # verify modifies nothing


def test_each_command_finds_nothing_in_a_cache_root_removed_after_it_was_checked(tmp_path, capsys, monkeypatch):
    """The whole cache directory goes (an operator's rm -r) after the command checked it is a directory and
    listed its namespaces, before it opens one: nothing to list, verify or purge, and not an error."""
    root = tmp_path / "cache"
    for action, args, expected in (("ls", (), "0 namespace(s)"), ("verify", ("--namespace", DIGEST[:16]),
                                   f"no disk cache namespace in {root}"),
                                   ("purge", ("--namespace", DIGEST[:16]), "removed 0 segment")):
        filled(root, DIGEST)
        removing_after_scan(monkeypatch, lambda: shutil.rmtree(root))
        status, out, err = cache_command(capsys, action, "--disk-cache", str(root), *args)
        assert status == 0 and expected in out and not err, (action, out, err)
        assert not root.exists()
