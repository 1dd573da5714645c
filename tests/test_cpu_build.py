"""cairn/ops/cpu_build.py, the build mechanism every CPU op shares: each source, build directory and torch
installation gets an extension name of its own (no rebuild ping-pong), each op names every csrc/ file it
compiles, and a build left unfinished by a killed process never blocks the next load."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cairn.ops import cpu_attention, cpu_build, cpu_gdn, cpu_gemv, cpu_norm, cpu_silu
from cairn.ops.cpu_build import CSRC, build, extension_name
from tests.cpu_paths import COMPILED

needs_kernel = pytest.mark.skipif(not COMPILED, reason="the CPU runs no compiled path (no AVX2 + FMA, or not x86)")
OPS = (cpu_attention, cpu_gdn, cpu_gemv, cpu_norm, cpu_silu)  # the CPU ops' modules (each op's C++: its CPP)


@needs_kernel
def test_a_build_into_another_directory_leaves_the_shared_build_alone(monkeypatch, tmp_path):
    """A build into a caller-given directory (here one that fails for want of a compiler, as the fallback
    tests do) gets an extension name of its own: the next load of the shared build in this process keeps
    the shared name and does not touch its build files. (With one name for both, torch's versioner saw the
    shared build as changed: it compiled `<name>_v1` into the shared directory, and the next process
    compiled it back, a minute or more each.)"""
    from torch.utils.cpp_extension import _get_build_directory

    shared = build(cpu_gemv.CPP)
    if isinstance(shared, str):
        pytest.skip(f"gemv kernel unavailable here: {shared}")
    ninja = Path(_get_build_directory(cpu_gemv.CPP.extension_name(None), False)) / "build.ninja"
    before = (ninja.read_text(), ninja.stat().st_mtime_ns)
    with monkeypatch.context() as env:
        env.setenv("CXX", str(tmp_path / "no-such-compiler"))
        elsewhere = build(cpu_gemv.CPP, str(tmp_path))
    assert elsewhere.startswith("building the kernel failed")
    again = build(cpu_gemv.CPP)
    assert again.__name__ == shared.__name__ == cpu_gemv.CPP.extension_name(None)
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

    if isinstance(cpu_silu.load(), str):
        pytest.skip(f"the fused silu op is not built here: {cpu_silu.load()}")
    stale = Path(_get_build_directory(cpu_silu.CPP.extension_name(None), False)) / "lock"
    stale.write_text("")  # what torch's FileBaton leaves when its holder is killed
    child = "from cairn.ops import cpu_silu; m = cpu_silu.load(); print(m if isinstance(m, str) else 'loaded')"
    try:
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
        assert done.stdout.strip() == "loaded", done.stderr[-2000:]
        assert not stale.exists()
        assert "removed the lock of a build that did not finish" in done.stderr
    finally:
        stale.unlink(missing_ok=True)


def test_a_build_is_named_by_the_bytes_of_its_sources_and_flags(tmp_path):
    """Editing the .cpp, or a header it includes, or a flag names a new build, which torch compiles into a directory
    of its own; the same files and flags, wherever they lie, name the same build (a checkout and an installation
    sharing a virtual environment share it)."""
    cpp = cpu_norm.CPP
    for f in (cpp.source, *cpp.headers):
        shutil.copy(CSRC / f, tmp_path / f)
    copy = dataclasses.replace(cpp, directory=tmp_path)
    assert copy.extension_name(None) == cpp.extension_name(None)
    names = {copy.extension_name(None)}
    for f in (cpp.source, *cpp.headers):
        text = (tmp_path / f).read_text()
        (tmp_path / f).write_text(text + "// an edit\n")
        names.add(copy.extension_name(None))
        (tmp_path / f).write_text(text)
    assert copy.extension_name(None) == cpp.extension_name(None)
    names.add(dataclasses.replace(copy, extra_cflags=()).extension_name(None))
    assert len(names) == 3 + len(cpp.headers)  # as it is, each file edited, the flags changed
    assert all(n.startswith(f"{cpp.name}_s") and n.isidentifier() for n in names)


def included(directory: Path, file: str) -> set[str]:
    """The files of `directory` that `file` includes ("..."), directly or through one another."""
    found = set(re.findall(r'^#include "([^"]+)"', (directory / file).read_text(), re.M))
    return found.union(*(included(directory, f) for f in found))


def test_each_op_names_the_headers_its_cpp_includes_and_csrc_holds_only_theirs():
    """Each op's CppSource lists exactly the csrc/ headers its .cpp includes (each is copied beside the .cpp into
    the build directory and hashed into the build's name), and every file of csrc/ belongs to an op."""
    used = set()
    for module in OPS:
        cpp = module.CPP
        assert set(cpp.headers) == included(CSRC, cpp.source), module.__name__
        used |= {cpp.source, *cpp.headers}
    assert {p.name for p in CSRC.iterdir()} == used
