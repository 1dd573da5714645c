"""cairn/ops/cpu_build.py, the build mechanism every CPU op shares: each build directory and torch
installation gets an extension name of its own (no rebuild ping-pong), and a build left unfinished by a
killed process never blocks the next load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cairn.ops import cpu_build, cpu_gemv
from cairn.ops.cpu_build import build_inline, extension_name
from tests.cpu_paths import COMPILED

needs_kernel = pytest.mark.skipif(not COMPILED, reason="the CPU runs no compiled path (no AVX2 + FMA, or not x86)")


@needs_kernel
def test_a_build_into_another_directory_leaves_the_shared_build_alone(monkeypatch, tmp_path):
    """A build into a caller-given directory (here one that fails for want of a compiler, as the fallback
    tests do) gets an extension name of its own: the next load of the shared build in this process keeps
    the shared name and does not touch its build files. (With one name for both, torch's versioner saw the
    shared build as changed: it compiled `<name>_v1` into the shared directory, and the next process
    compiled it back, a minute or more each.)"""
    from torch.utils.cpp_extension import _get_build_directory

    functions = cpu_gemv.FUNCTIONS
    shared = build_inline(cpu_gemv.NAME, cpu_gemv._SOURCE, functions, "the kernel")
    if isinstance(shared, str):
        pytest.skip(f"gemv kernel unavailable here: {shared}")
    ninja = Path(_get_build_directory(extension_name(cpu_gemv.NAME, None), False)) / "build.ninja"
    before = (ninja.read_text(), ninja.stat().st_mtime_ns)
    with monkeypatch.context() as env:
        env.setenv("CXX", str(tmp_path / "no-such-compiler"))
        elsewhere = build_inline(cpu_gemv.NAME, cpu_gemv._SOURCE, functions, "the kernel", str(tmp_path))
    assert elsewhere.startswith("building the kernel failed")
    again = build_inline(cpu_gemv.NAME, cpu_gemv._SOURCE, functions, "the kernel")
    assert again.__name__ == shared.__name__ == extension_name(cpu_gemv.NAME, None)
    assert (ninja.read_text(), ninja.stat().st_mtime_ns) == before


def test_each_build_directory_and_each_torch_install_gets_its_own_extension_name(monkeypatch, tmp_path):
    """A build into another directory, or against another torch installation (another virtual environment on
    the machine), never shares a name with the shared build: torch would take their build.ninja files for one
    changed build and compile each again after the other."""
    names = {extension_name("cairn_op", str(tmp_path / d)) for d in ("a", "b")}
    names.add(extension_name("cairn_op", None))
    monkeypatch.setattr(cpu_build, "_torch_install", lambda: str(tmp_path / "venv2" / "torch"))
    names.add(extension_name("cairn_op", None))
    assert len(names) == 4 and all(n.startswith("cairn_op_") and n.isidentifier() for n in names)
    assert extension_name("cairn_op", str(tmp_path / "a")) in names  # the same directory, the same name


def test_a_build_left_unfinished_by_a_killed_process_does_not_block_the_next_one():
    """A build killed midway leaves torch's `lock` file in its directory, on which torch's next load there
    would wait forever (a server stopped during its start-up build hung at every later start): the next
    load finds it stale, removes it, and loads. Planted in the build directory of an op set-up built (the
    fused silu op: no compile here, which would take a minute), loaded in a child so that a regression
    fails, not hangs; the planted file is removed whatever happens."""
    from torch.utils.cpp_extension import _get_build_directory

    from cairn.ops import cpu_silu

    if isinstance(cpu_silu.load(), str):
        pytest.skip(f"the fused silu op is not built here: {cpu_silu.load()}")
    stale = Path(_get_build_directory(extension_name(cpu_silu.NAME, None), False)) / "lock"
    stale.write_text("")  # what torch's FileBaton leaves when its holder is killed
    child = "from cairn.ops import cpu_silu; m = cpu_silu.load(); print(m if isinstance(m, str) else 'loaded')"
    try:
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
        assert done.stdout.strip() == "loaded", done.stderr[-2000:]
        assert not stale.exists()
        assert "removed the lock of a build that did not finish" in done.stderr
    finally:
        stale.unlink(missing_ok=True)
