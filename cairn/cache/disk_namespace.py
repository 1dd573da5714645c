"""The disk tier's on-disk namespace: names, private directories, no-follow reads, atomic writes,
the lock, and the offline operations behind `cairn cache ls|verify|purge`.

    <root>/                      0o700 when created here
      <compat_digest>/           the namespace, 0o700; nothing outside it is ever written or deleted
        .lock                    flock'd by the one process that writes and evicts (0o600)
        <key hex>.seg            a complete segment file (segment.py), 0o600
        .tmp-<pid>-<16 hex>      a write in progress; a leftover one is removed at start-up

Every file is opened relative to the namespace's directory fd with O_NOFOLLOW, so no symlink is
ever followed, and only regular files with these names are ever deleted.

This module is NOT the live store (disk_store.py: index, budget, eviction, pins, fault counters)
nor the file format (segment.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import NamedTuple

from cairn.cache.segment import (
    DEFAULT_LIMITS,
    END_BYTES,
    HEADER_BYTES,
    SectionHasher,
    Segment,
    SegmentError,
    SegmentLimits,
    check_end_marker,
    decode_segment,
    decode_tokens,
    digest_bytes,
    read_header,
    tokens_section_bytes,
)

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
SEGMENT_NAME = re.compile(r"[0-9a-f]{64}\.seg")
TEMP_NAME = re.compile(r"\.tmp-[0-9]+-[0-9a-f]{16}")
FILE_MODE = 0o600
DIR_MODE = 0o700
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang us
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskStoreError(Exception):
    """The namespace cannot be used at all (a symlink, not a directory, owned by someone else)."""


class StoreLockedError(DiskStoreError):
    """Another process holds the namespace's lock."""


class UnusableEntry(Exception):
    """A directory entry that is not ours to read, replace or delete.

    `reason`: "symlink", "not_regular", or "name_taken" (a write found a non-file at its name).
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class NamespaceSummary(NamedTuple):
    digest: str  # the namespace's compatibility digest (its directory name)
    num_segments: int  # files named like segments (not validated)
    size_bytes: int  # their total size


class VerifyResult(NamedTuple):
    ok: int  # segment files that passed every check
    bad: list[tuple[str, str]]  # (file name, reason) for every one that did not


def segment_file_name(key: bytes) -> str:
    return key.hex() + ".seg"


# ---------------------------------------------------------------------------------------------- files


def _write_all(fd: int, parts) -> None:
    """Write every part in order, looping over short writes; raises OSError."""
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view) :]


def open_regular(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """Open name for reading without following links; raises UnusableEntry if it is not a regular file."""
    try:
        fd = os.open(name, _OPEN_READ, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnusableEntry("symlink") from None
        if e.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket
            raise UnusableEntry("not_regular") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnusableEntry("not_regular")
    return fd, st


def read_segment_file(dir_fd: int, name: str, compat_digest: str, limits: SegmentLimits) -> Segment:
    """Read and fully verify one segment file; raises SegmentError, UnusableEntry or OSError."""
    fd, st = open_regular(dir_fd, name)
    try:
        if st.st_size == 0 or st.st_size > limits.max_file_bytes:
            read_header(b"", compat_digest, st.st_size, limits)  # raises empty / oversized
        view = memoryview(bytearray(st.st_size))
        hasher, got = _read_hashing(fd, view)
    finally:
        os.close(fd)
    segment = decode_segment(view[:got] if got < view.nbytes else view, compat_digest, limits, hasher)
    if segment_file_name(segment.key) != name:
        raise SegmentError("malformed", "the key differs from the file name")
    return segment


# Reads of this size overlap with the kernel's readahead, where one read of the whole file waits for
# it (measured: 16 ms against 20-25 ms for a 20 MiB file not in the page cache), and hand the
# checksum thread work early.
READ_BLOCK_BYTES = 1 << 20
_verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cairn-segment-verify")


def _read_hashing(fd: int, view: memoryview) -> tuple[SectionHasher, int]:
    """Read the file into `view` block by block while a worker thread checksums the sections that have
    arrived (both release the GIL): verifying a restore costs little more than reading it."""
    hasher, got, pending = SectionHasher(view), 0, None
    try:
        while got < view.nbytes and (n := os.readv(fd, [view[got : got + READ_BLOCK_BYTES]])):
            got += n
            pending = _verifier.submit(hasher.advance, got)
    finally:
        if pending is not None:
            pending.result()  # in order: the worker runs one task at a time
    return hasher, got


def read_segment_tokens(dir_fd: int, name: str, compat_digest: str, limits: SegmentLimits) -> tuple[int, ...]:
    """The verified tokens of one segment file, reading only its header and tokens section."""
    fd, st = open_regular(dir_fd, name)
    try:
        head = os.pread(fd, HEADER_BYTES, 0) if 0 < st.st_size <= limits.max_file_bytes else b""
        header = read_header(head, compat_digest, st.st_size, limits)
        section = os.pread(fd, tokens_section_bytes(header), HEADER_BYTES)
    finally:
        os.close(fd)
    return decode_tokens(section, header)


def read_index_header(dir_fd: int, name: str, compat_digest: str, limits: SegmentLimits):
    """Cheap validation for the index: header, size and end marker. Returns (header, stat)."""
    fd, st = open_regular(dir_fd, name)
    try:
        head = os.pread(fd, HEADER_BYTES, 0) if 0 < st.st_size <= limits.max_file_bytes else b""
        header = read_header(head, compat_digest, st.st_size, limits)
        check_end_marker(os.pread(fd, END_BYTES, header.file_bytes - END_BYTES), header)
    finally:
        os.close(fd)
    if segment_file_name(header.key) != name:
        raise SegmentError("malformed", "the key differs from the file name")
    return header, st


def unlink_ours(dir_fd: int, name: str) -> bool:
    """Delete name if it is a regular file with one of our names; never a link, directory or foreign file."""
    if not (SEGMENT_NAME.fullmatch(name) or TEMP_NAME.fullmatch(name) or name == LOCK_NAME):
        return False
    try:
        if not stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
            return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False


def _make_private_dir(path: str, dir_fd: int | None = None) -> None:
    """mkdir with mode 0o700 (exactly, whatever the umask); an existing entry is left as it is."""
    try:
        os.mkdir(path, DIR_MODE, dir_fd=dir_fd)
    except FileExistsError:
        return
    fd = os.open(path, _OPEN_DIR, dir_fd=dir_fd)
    try:
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def open_namespace(root, compat_digest: str, create: bool) -> int | None:
    """A directory fd on <root>/<compat_digest>; None if it does not exist and create is False."""
    digest_bytes(compat_digest)  # only hex names: no path tricks
    root = os.path.abspath(os.fspath(root))
    if create:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        _make_private_dir(root)
    elif not os.path.isdir(root):
        return None
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself may be a link
    try:
        if create:
            _make_private_dir(compat_digest, dir_fd=root_fd)
        fd = os.open(compat_digest, _OPEN_DIR, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DiskStoreError(f"namespace {compat_digest} in {root} is not a plain directory: {e}") from None
    finally:
        os.close(root_fd)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise DiskStoreError(f"namespace {compat_digest} in {root} belongs to uid {st.st_uid}")
    if st.st_mode & 0o077:
        logger.warning("disk cache namespace %s/%s is accessible to other users", root, compat_digest)
    return fd


def try_lock(dir_fd: int) -> int | None:
    """An fd holding the namespace's exclusive flock, or None if another process holds it."""
    fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "lock is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    return fd


def write_atomic(dir_fd: int, name: str, parts) -> bool:
    """Make `name` hold exactly the bytes of `parts`, or leave the directory as it was.

    Writes a private temp file in the same directory, fsyncs it, renames it over `name` and fsyncs
    the directory, so a reader sees either the previous file or the complete new one. Raises
    OSError (after removing the temp file) or UnusableEntry("name_taken") if `name` is a link or
    not a regular file. Returns False when only the directory fsync failed: the file is complete
    and visible, but its name may not survive a power loss.
    """
    with suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
            raise UnusableEntry("name_taken")
    temp = f".tmp-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        fd = os.open(temp, _OPEN_WRITE, FILE_MODE, dir_fd=dir_fd)
        try:
            os.fchmod(fd, FILE_MODE)
            _write_all(fd, parts)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        with suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    try:
        os.fsync(dir_fd)
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- CLI


def _namespace_names(root) -> list[str]:
    """Names of the namespace directories under root (hex names, real directories, not links)."""
    if not os.path.isdir(root):
        return []
    with os.scandir(root) as entries:
        names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    return sorted(n for n in names if re.fullmatch(r"(?:[0-9a-f]{2}){1,64}", n))


def list_namespaces(root) -> list[NamespaceSummary]:
    """Every namespace under root with its number of segment files and their bytes. Reads no file."""
    out = []
    for digest in _namespace_names(root):
        fd = open_namespace(root, digest, create=False)
        if fd is None:
            continue
        try:
            stats = [os.lstat(n, dir_fd=fd) for n in os.listdir(fd) if SEGMENT_NAME.fullmatch(n)]
        finally:
            os.close(fd)
        sizes = [st.st_size for st in stats if stat.S_ISREG(st.st_mode)]
        out.append(NamespaceSummary(digest, len(sizes), sum(sizes)))
    return out


def verify_store(root, namespace: str | None = None,
                 limits: SegmentLimits = DEFAULT_LIMITS) -> dict[str, VerifyResult]:
    """{digest: VerifyResult} after reading and verifying every segment file of each namespace
    (or only `namespace`). Modifies nothing, takes no lock; foreign names and temp files are ignored."""
    results = {}
    for digest in [namespace] if namespace is not None else _namespace_names(root):
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
    subdirectories are left in place (and then so is the directory).
    """
    fd = open_namespace(root, digest, create=False)
    if fd is None:
        return 0
    try:
        lock_fd = try_lock(fd)
        if lock_fd is None:
            raise StoreLockedError(f"namespace {digest} is in use by another process")
        try:
            removed = sum(unlink_ours(fd, name) for name in os.listdir(fd) if name != LOCK_NAME)
            unlink_ours(fd, LOCK_NAME)
        finally:
            os.close(lock_fd)
    finally:
        os.close(fd)
    with suppress(OSError):
        os.rmdir(os.path.join(os.fspath(root), digest))
    return removed
