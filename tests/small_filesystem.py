"""Test helper: a real filesystem of a few MiB (a tmpfs mounted on a directory of the test's), so that a write
meets a true ENOSPC and the free space the store measures is the kernel's. `small_filesystem(path, size_bytes)`
mounts it, yields the path, and unmounts it; the test is skipped where it cannot be mounted (a user without
the privilege, a container without mount). Not a test module: it holds no assertions.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_filesystem(path: Path, size_bytes: int) -> Iterator[Path]:
    path.mkdir()
    mount = shutil.which("mount")
    out = mount and subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)],
                                   capture_output=True, text=True, timeout=30)
    if not out or out.returncode:
        pytest.skip(f"a small tmpfs cannot be mounted here: {out.stderr.strip() if out else 'no mount command'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(path: Path, leave_bytes: int) -> int:
    """Write a file of another program's at `path` taking all of its filesystem's free space but `leave_bytes`;
    returns its size."""
    free = shutil.disk_usage(path.parent).free
    size = max(0, free - leave_bytes)
    path.write_bytes(b"\0" * size)
    return size
