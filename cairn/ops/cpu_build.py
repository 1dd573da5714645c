"""Building cairn's CPU C++ ops (cpu_gemv, cpu_gdn, cpu_norm, cpu_silu, cpu_attention) from csrc/: torch's `load`.

What it is: each op's module names its C++ as a `CppSource` (its .cpp in cairn/ops/csrc/, the csrc/ headers that
.cpp includes, its extra compile flags); `build` compiles it on first use (torch caches the build under its
extensions directory by name, so a machine compiles each source once) and returns the module, or a one-line
reason why not (no compiler, no headers, a failed build), which the op's module logs once before its caller keeps
the reference. What it is not: a place that decides which op runs.

Each build gets an extension name of its own (`CppSource.extension_name`): the op's name, a short hash of its
sources' bytes and its flags (`CppSource.digest`: editing the .cpp or a header it includes names a new build,
and nothing else does), and a short hash of the torch installation it builds against, or of the caller-given
directory it builds into (`extension_name`). torch keys a build by name alone: its build.ninja holds the absolute
paths of torch's headers and libraries, so two virtual environments on one machine (a developer's and a fresh
clone's CI run) sharing a name would each find the other's build changed and compile it again, every time they
take turns. And torch's in-process versioner hashes the build directory with the source: had a build into
another directory kept the shared name, the next load of the shared build in that process would count as changed
and compile `<name>_v1` into the shared directory, and the next fresh process (back on `<name>`) would compile it
again: a minute or more each time, for nothing.

The sources are copied into the build directory and compiled there (each written only when its bytes differ, so
ninja sees a change only where the source changed): build.ninja names its sources by absolute path, so compiling
them where cairn lies would give two checkouts or installations sharing one virtual environment, and so one
name, two build.ninja files, each compiling again after the other.

A build killed midway (a server stopped during its start-up build) leaves torch's `lock` file in the build
directory, and torch waits for that file to go away before it loads or builds there: forever. So every
build or load holds a lock of cairn's own on the directory (`fcntl.flock`, which the kernel drops when its
holder dies, even by SIGKILL); whoever holds it knows no cairn process is building there, and removes a
`lock` file it finds as left by a dead build.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BASE_CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
CSRC = Path(__file__).with_name("csrc")  # the ops' C++ sources


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:10]


@functools.cache
def _torch_install() -> str:
    import torch

    return os.path.dirname(os.path.realpath(torch.__file__))


def extension_name(name: str, build_dir: str | None) -> str:
    """The extension name a build into `build_dir` uses: in torch's extensions directory (None), `name` plus a
    short hash of the torch installation (one build per virtual environment); elsewhere `name` plus a short
    hash of the directory's absolute path. Builds that differ in either never share a name, a versioner
    entry or a build.ninja."""
    if build_dir is None:
        return f"{name}_t{_short_hash(_torch_install())}"
    return f"{name}_d{_short_hash(os.path.abspath(build_dir))}"


@dataclass(frozen=True)
class CppSource:
    """One CPU op's C++ and how it compiles: a translation unit in csrc/ and the csrc/ headers it includes."""

    name: str  # the op's name ("cairn_cpu_norm2"); its build's name adds the hashes (extension_name)
    source: str  # the .cpp torch compiles, in `directory` (it ends with the op's PYBIND11_MODULE)
    what: str  # the op in a failure's line: "building <what> failed (...)"
    headers: tuple[str, ...] = ()  # the files of `directory` that `source` includes ("..."), copied and hashed with it
    extra_cflags: tuple[str, ...] = ()  # compile flags beyond BASE_CFLAGS
    directory: Path = CSRC  # where the files are (tests point it at edited copies)

    def digest(self) -> str:
        """A short hash of every file's name and bytes and of the flags: what the compiler gets."""
        h = hashlib.sha1()
        for f in (self.source, *self.headers):
            h.update(f.encode() + b"\0" + (self.directory / f).read_bytes() + b"\0")
        h.update("\0".join([*BASE_CFLAGS, *self.extra_cflags, *LDFLAGS]).encode())
        return h.hexdigest()[:10]

    def extension_name(self, build_dir: str | None) -> str:
        """The build's name: the op's name, `s` and its digest, then extension_name's per-install (or
        per-directory) part."""
        return extension_name(f"{self.name}_s{self.digest()}", build_dir)


def build(cpp: CppSource, build_dir: str | None = None):
    """The built module of `cpp` (what its PYBIND11_MODULE exports), or "building <what> failed (<error's first
    line>)". Never raises. `build_dir`: where to build (None: torch's extensions directory); the build's name is
    `cpp.extension_name(build_dir)`, and its sources are copied into the build directory and compiled there."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        ext = cpp.extension_name(build_dir)
        directory = build_dir or _get_build_directory(ext, False)
        with _only_builder(directory):
            for f in (cpp.source, *cpp.headers):
                _write_if_changed(os.path.join(directory, f), (cpp.directory / f).read_bytes())
            return load(ext, sources=[os.path.join(directory, cpp.source)], build_directory=directory,
                        extra_cflags=[*BASE_CFLAGS, *cpp.extra_cflags], extra_ldflags=list(LDFLAGS), verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build: the caller keeps the reference
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return f"building {cpp.what} failed ({type(e).__name__}: {first[:200]})"


def _write_if_changed(path: str, data: bytes) -> None:
    """Write `data` to `path` unless it holds it already (an untouched file keeps its mtime: ninja sees no change)."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        if f.read() == data:
            return
    with open(path, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def _only_builder(directory: str):
    """Held while this process builds or loads in `directory`: no other cairn process does meanwhile, so a
    torch `lock` file found there was left by a build that died, and is removed (torch would wait on it
    forever)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "cairn.lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, "lock"))
            log.warning("removed the lock of a build that did not finish, in %s", directory)
        yield


def build_command(argv: list[str] | None, module: str, what: str, built) -> int:
    """`python -m cairn.ops.<module> --build`, which scripts/setup runs: build the op now (or find it in torch's
    cache) and print one line, `cairn <what>: <built()>`, what was built or "none (why)". Exits 0 either way: a
    machine without a compiler still sets up (bf16 decode then keeps the reference)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m cairn.ops.{module}", description=f"Build cairn's {what}.")
    parser.add_argument("--build", action="store_true", required=True, help="build it now (or find it built)")
    parser.parse_args(argv)
    print(f"cairn {what}: {built()}")
    return 0


def built_or_why(loaded) -> str:
    """"built", or "none (<why>)" for a load that returned its reason."""
    return f"none ({loaded})" if isinstance(loaded, str) else "built"
