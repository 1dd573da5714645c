"""The offline operations behind `cairn cache ls | verify | purge`, on a disk cache directory that a
server may be using at the same time: they read without locking, and purge refuses a namespace whose
lock is held. Namespaces may be named by the short id the server's start-up log prints (a prefix
of the compatibility digest). What this is not: the live store (store.py) or the CLI (admin.py).
"""

from __future__ import annotations

import os
import re
import stat
from contextlib import suppress
from typing import NamedTuple

from cairn.cache.disk.namespace import (
    LOCK_NAME,
    MODEL_NAME,
    SEGMENT_NAME,
    DiskStoreError,
    StoreLockedError,
    UnusableEntry,
    open_namespace,
    read_model_name,
    read_segment_file,
    try_lock,
    unlink_ours,
)
from cairn.cache.segments.segment import DEFAULT_LIMITS, SegmentError, SegmentLimits

SHORT_ID_CHARS = 16  # the namespace id the server's start-up log prints


class NamespaceSummary(NamedTuple):
    digest: str  # the namespace's compatibility digest (its directory name)
    num_segments: int  # files named like segments (not validated)
    size_bytes: int  # their total size
    model: str | None = None  # the model it belongs to, as the server that wrote it named it


class VerifyResult(NamedTuple):
    ok: int  # segment files that passed every check
    bad: list[tuple[str, str]]  # (file name, reason) for every one that did not


def namespace_names(root) -> list[str]:
    """Names of the namespace directories under root (hex names, real directories, not links)."""
    if not os.path.isdir(root):
        return []
    with os.scandir(root) as entries:
        names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    return sorted(n for n in names if re.fullmatch(r"(?:[0-9a-f]{2}){1,64}", n))


def resolve_namespace(root, namespace_id: str) -> str:
    """The full digest of the one namespace under root whose name starts with namespace_id (the short id
    of the start-up log, or the whole digest). Raises DiskStoreError when none or several match."""
    wanted = namespace_id.strip().lower()
    matches = [n for n in namespace_names(root) if wanted and n.startswith(wanted)]
    if not matches:
        raise DiskStoreError(f"no namespace {namespace_id!r} in {root} (see cairn cache ls)")
    if len(matches) > 1:
        raise DiskStoreError(f"namespace id {namespace_id!r} matches {len(matches)} namespaces in {root}; "
                             "give more of it")
    return matches[0]


def list_namespaces(root) -> list[NamespaceSummary]:
    """Every namespace under root with its segment files, their bytes and its model. Reads no segment."""
    out = []
    for digest in namespace_names(root):
        fd = open_namespace(root, digest, create=False)
        if fd is None:
            continue
        try:
            stats = [os.lstat(n, dir_fd=fd) for n in os.listdir(fd) if SEGMENT_NAME.fullmatch(n)]
            model = read_model_name(fd)
        finally:
            os.close(fd)
        sizes = [st.st_size for st in stats if stat.S_ISREG(st.st_mode)]
        out.append(NamespaceSummary(digest, len(sizes), sum(sizes), model))
    return out


def verify_store(root, namespace: str | None = None,
                 limits: SegmentLimits = DEFAULT_LIMITS) -> dict[str, VerifyResult]:
    """{digest: VerifyResult} after reading and verifying every segment file of each namespace
    (or only `namespace`). Modifies nothing, takes no lock; foreign names and temp files are ignored."""
    results = {}
    for digest in [namespace] if namespace is not None else namespace_names(root):
        fd = open_namespace(root, digest, create=False)
        if fd is None:
            continue
        try:
            results[digest] = _verify_namespace(fd, digest, limits)
        finally:
            os.close(fd)
    return results


def _verify_namespace(dir_fd: int, digest: str, limits: SegmentLimits) -> VerifyResult:
    ok, bad = 0, []
    for name in sorted(os.listdir(dir_fd)):
        if not SEGMENT_NAME.fullmatch(name):
            continue
        try:
            read_segment_file(dir_fd, name, digest, limits)
            ok += 1
        except (SegmentError, UnusableEntry) as e:
            bad.append((name, e.reason))
        except FileNotFoundError:
            pass
        except OSError:
            bad.append((name, "read_failed"))
    return VerifyResult(ok, bad)


def purge_namespace(root, digest: str) -> int:
    """Delete a namespace's segment and temp files, its lock, then the directory if it is empty.

    Returns the number of segment and temp files removed. Raises StoreLockedError, deleting
    nothing, while another process holds the namespace's lock. Foreign files, links and
    subdirectories (the quarantine too) are left in place (and then so is the directory).
    """
    fd = open_namespace(root, digest, create=False)
    if fd is None:
        return 0
    try:
        lock_fd = try_lock(fd)
        if lock_fd is None:
            raise StoreLockedError(f"namespace {digest} is in use by another process")
        try:
            removed = sum(unlink_ours(fd, name) for name in os.listdir(fd) if name not in (LOCK_NAME, MODEL_NAME))
            unlink_ours(fd, MODEL_NAME)
            unlink_ours(fd, LOCK_NAME)
        finally:
            os.close(lock_fd)
    finally:
        os.close(fd)
    with suppress(OSError):
        os.rmdir(os.path.join(os.fspath(root), digest))
    return removed
