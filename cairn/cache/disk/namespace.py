"""The disk tier's on-disk namespace: names, private directories, no-follow reads, atomic writes,
the lock, and the offline operations behind `cairn cache ls|verify|purge`.

    <root>/                      0o700 when created here (its parent must exist unless create_parents);
                                 never a symlink, and owned by the user
      <compat_digest>/           the namespace, 0o700; nothing outside it is ever written or deleted
        .lock                    flock'd by the one process that writes and evicts (0o600)
        .model                   the name of the model the namespace belongs to (for `cairn cache ls`)
        <key hex>.seg            a complete segment file (segment.py), 0o600
        .tmp-<pid>-<16 hex>      a write in progress; a leftover one is removed at start-up
        quarantine/              entries named like segments that are not regular files (a symlink,
                                 a FIFO, a directory), moved aside by the lock holder, never followed

Every file is opened relative to the namespace's directory fd with O_NOFOLLOW, so no symlink is
ever followed, and only regular files with these names are ever deleted.

This module is NOT the live store (store.py: index, budget, eviction, pins, fault counters),
the offline operations behind `cairn cache` (offline.py) nor the file format (segment.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from contextlib import suppress
from typing import NamedTuple

from cairn.cache.segments.decode import (
    check_end_marker,
    decode_segment,
    decode_tokens,
    read_header,
    tokens_section_bytes,
)
from cairn.cache.segments.segment import END_BYTES, HEADER_BYTES, Segment, SegmentError, SegmentLimits, digest_bytes

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
MODEL_NAME = ".model"
QUARANTINE_NAME = "quarantine"
MAX_MODEL_NAME_BYTES = 4096
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


class ReadBuffer:
    """One buffer that segment files are read into, again and again: no allocation and no page faults per
    read, which a fresh 20 MiB buffer costs as much as a tenth of the read. Grown to the largest file read,
    never shrunk. A segment read into it is valid only until the next read: for a caller that copies the
    bytes out at once (a snapshot restore), from one thread at a time."""

    def __init__(self):
        self._data = bytearray()

    def view(self, nbytes: int) -> memoryview:
        if len(self._data) < nbytes:
            self._data = bytearray(nbytes)  # a view of the old one may still be held: replace, never resize
        return memoryview(self._data)[:nbytes]


def read_segment_file(dir_fd: int, name: str, compat_digest: str, limits: SegmentLimits,
                      buffer: ReadBuffer | None = None) -> Segment:
    """Read and fully verify one segment file; raises SegmentError, UnusableEntry or OSError.

    The segment's KV, snapshot and logits are views of the bytes read: of `buffer` when given (valid until
    its next read), else of a buffer of their own."""
    fd, st = open_regular(dir_fd, name)
    try:
        if st.st_size == 0 or st.st_size > limits.max_file_bytes:
            read_header(b"", compat_digest, st.st_size, limits)  # raises empty / oversized
        view = buffer.view(st.st_size) if buffer is not None else memoryview(bytearray(st.st_size))
        got = _read_into(fd, view)
    finally:
        os.close(fd)
    segment = decode_segment(view[:got], compat_digest, limits)
    if segment_file_name(segment.key) != name:
        raise SegmentError("malformed", "the key differs from the file name")
    return segment


# Reads of this size overlap with the kernel's readahead, where one read of the whole file waits for
# it (measured: 16 ms against 20-25 ms for a 20 MiB file not in the page cache).
READ_BLOCK_BYTES = 1 << 20


def _read_into(fd: int, view: memoryview) -> int:
    """Read the file into `view`, block by block, until it is full or the file ends; returns bytes read."""
    got = 0
    while got < view.nbytes and (n := os.readv(fd, [view[got : got + READ_BLOCK_BYTES]])):
        got += n
    return got


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
    if not (SEGMENT_NAME.fullmatch(name) or TEMP_NAME.fullmatch(name) or name in (LOCK_NAME, MODEL_NAME)):
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


def _check_root(root: str) -> None:
    """Refuse a cache root that is a symlink, not a directory, or owned by another user."""
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise DiskStoreError(f"disk cache {root} is a symbolic link; give the directory it points to")
    if not stat.S_ISDIR(st.st_mode):
        raise DiskStoreError(f"disk cache {root} is not a directory")
    if st.st_uid != os.geteuid():
        raise DiskStoreError(f"disk cache {root} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")


def _make_namespace(root: str, compat_digest: str, root_fd: int) -> None:
    """Create the namespace in the root unless it exists; DiskStoreError when it cannot be (a read-only cache
    directory filled by other models, dtypes or settings holds nothing for this one)."""
    try:
        _make_private_dir(compat_digest, dir_fd=root_fd)
    except FileNotFoundError:  # the root vanished: open_namespace answers None
        return
    except OSError as e:
        if os.path.isdir(os.path.join(root, compat_digest)):
            return  # there after all (a concurrent server made it between the two calls)
        raise DiskStoreError(f"disk cache {root} holds no namespace {compat_digest[:16]} for this model (its "
                             f"weights, dtype and settings) and one cannot be created there: {e.strerror or e}"
                             ) from None


def _make_root(root: str, create_parents: bool) -> None:
    parent = os.path.dirname(root)
    try:
        if create_parents:
            os.makedirs(parent, DIR_MODE, exist_ok=True)
        elif not os.path.isdir(parent):
            raise DiskStoreError(f"disk cache {root}: the directory {parent} does not exist "
                                 "(create it, or pass --disk-cache-create-parents)")
        _make_private_dir(root)
    except OSError as e:  # a read-only filesystem, a parent we may not write
        raise DiskStoreError(f"disk cache {root} does not exist and cannot be created: {e.strerror or e}") from None


def open_namespace(root, compat_digest: str, create: bool, create_parents: bool = False) -> int | None:
    """A directory fd on <root>/<compat_digest>; None if it does not exist and create is False.

    create makes the root (only its last component, unless create_parents) and the namespace.
    Raises DiskStoreError when the root is a symlink, not a directory or another user's."""
    digest_bytes(compat_digest)  # only hex names: no path tricks
    root = os.path.abspath(os.fspath(root))
    if create:
        _make_root(root, create_parents)
    elif not os.path.lexists(root):
        return None
    _check_root(root)
    root_fd = os.open(root, _OPEN_DIR)
    try:
        if create:
            _make_namespace(root, compat_digest, root_fd)
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


def set_aside(dir_fd: int, name: str) -> bool:
    """Move the entry `name` (a link or non-regular entry, never followed) into the quarantine
    subdirectory, so it is not met again at every start-up. False when that failed."""
    try:
        _make_private_dir(QUARANTINE_NAME, dir_fd=dir_fd)
        quarantine = os.open(QUARANTINE_NAME, _OPEN_DIR, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        os.rename(name, name, src_dir_fd=dir_fd, dst_dir_fd=quarantine)
        return True
    except OSError:
        return False
    finally:
        os.close(quarantine)


def write_model_name(dir_fd: int, model: str) -> None:
    """Record which model the namespace belongs to (best effort: `cairn cache ls` shows it)."""
    with suppress(OSError, UnusableEntry):
        if read_model_name(dir_fd) != model:
            write_atomic(dir_fd, MODEL_NAME, [model.encode()[:MAX_MODEL_NAME_BYTES]])


def read_model_name(dir_fd: int) -> str | None:
    """The .model file's text (bytes that are not UTF-8 escaped as \\xNN), or None when there is none. It may
    hold anything: whoever prints it escapes its control characters (admin.py)."""
    try:
        fd, _ = open_regular(dir_fd, MODEL_NAME)
    except (OSError, UnusableEntry):
        return None
    try:
        return os.read(fd, MAX_MODEL_NAME_BYTES).decode(errors="backslashreplace")
    finally:
        os.close(fd)


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
