"""Building cairn's CPU C++ ops (cpu_gemv, cpu_gdn, cpu_norm, cpu_silu): one call of torch's load_inline.

What it is: `build_inline` compiles an op's source on first use (torch caches the build under its
extensions directory by name, so a machine compiles each source once) and returns the module, or a
one-line reason why not (no compiler, no headers, a failed build), which the op's module logs once
before its caller keeps the reference. What it is not: a place that decides which op runs.

A build into a caller-given directory gets its own extension name (`extension_name`). torch's in-process
versioner keys builds by name and hashes the build directory with the source: had a build into another
directory kept the shared name, the next load of the shared build in that process would count as changed
and compile `<name>_v1` into the shared directory, and the next fresh process (back on `<name>`) would find
that directory's build.ninja changed and compile it again: a minute or more each time, for nothing.
"""

from __future__ import annotations

import hashlib
import os

BASE_CFLAGS = ("-O3", "-fopenmp")


def extension_name(name: str, build_dir: str | None) -> str:
    """The extension name a build into `build_dir` uses: `name` itself in torch's extensions directory
    (None), else `name` plus a short hash of the directory's absolute path, so that builds elsewhere never
    share a name, a versioner entry or a build.ninja with the shared build."""
    if build_dir is None:
        return name
    digest = hashlib.sha1(os.path.abspath(build_dir).encode()).hexdigest()[:10]
    return f"{name}_d{digest}"


def build_inline(name: str, source: str, functions: list[str], what: str, build_dir: str | None = None,
                 extra_cflags: tuple[str, ...] = ()):
    """The built module exporting `functions`, or "building <what> failed (<error's first line>)". Never
    raises. `build_dir`: where to build (None: torch's extensions directory, under `name`; elsewhere the
    build gets a name of its own, see `extension_name`)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(extension_name(name, build_dir), cpp_sources=source, functions=functions,
                           build_directory=build_dir, extra_cflags=[*BASE_CFLAGS, *extra_cflags],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build: the caller keeps the reference
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return f"building {what} failed ({type(e).__name__}: {first[:200]})"
