"""Building cairn's CPU C++ ops (cpu_gemv, cpu_gdn, cpu_norm, cpu_silu): one call of torch's load_inline.

What it is: `build_inline` compiles an op's source on first use (torch caches the build under its
extensions directory by name, so a machine compiles each source once) and returns the module, or a
one-line reason why not (no compiler, no headers, a failed build), which the op's module logs once
before its caller keeps the reference. What it is not: a place that decides which op runs.
"""

from __future__ import annotations

BASE_CFLAGS = ("-O3", "-fopenmp")


def build_inline(name: str, source: str, functions: list[str], what: str, build_dir: str | None = None,
                 extra_cflags: tuple[str, ...] = ()):
    """The built module exporting `functions`, or "building <what> failed (<error's first line>)". Never
    raises. `build_dir`: where to build (None: torch's extensions directory)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name, cpp_sources=source, functions=functions, build_directory=build_dir,
                           extra_cflags=[*BASE_CFLAGS, *extra_cflags], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build: the caller keeps the reference
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return f"building {what} failed ({type(e).__name__}: {first[:200]})"
