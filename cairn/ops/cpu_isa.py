"""The CPU instruction path of cairn's compiled ops: the best the CPU has, or one forced lower.

A path names the instructions every compiled CPU op of a process runs (the gemv kernel's path and the
widest vector body of the fused GDN, silu and attention ops), from highest to lowest:

    amx_bf16      AMX tiles for the gemv; AVX-512 bodies for the fused ops   (Sapphire Rapids and later Xeons)
    avx512_bf16   AVX512-BF16 dot products for the gemv; AVX-512 bodies     (Zen 4 and later, Cooper Lake)
    avx2          AVX2 + FMA for the gemv (packed weights, every row); AVX2 bodies   (Zen 1-3, Haswell and later)
    none          no compiled op at all: the PyTorch reference kernels      (any CPU: ARM, or no C++ compiler)

`best_path(flags, machine)` is the highest path a CPU's /proc/cpuinfo flags allow (none on a machine that is
not x86: the ops are x86 C++). `choose(requested, flags, machine)` is the path a process runs: `auto` is the
best one; a named path at or below it is taken as asked (an AMX Xeon can run the avx512_bf16 and avx2 paths,
a Zen 4 the avx2 path, any machine none), one above it is refused in one line. Only the command line and the
config read the request (`--cpu-isa`, or the CAIRN_CPU_ISA environment variable); the engine resolves it once
at start-up, logs it, and hands the path to the kernels and the weight layout.

What this is not: a guarantee that a path's ops build (a missing compiler or a failed build leaves the
reference kernels, said in one line by whoever loads them), nor the choice of oneDNN's or ATen's own
instructions (ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY cap those, for a whole process).
"""

from __future__ import annotations

import platform as _platform

from cairn.config import ConfigError

PATHS = ("none", "avx2", "avx512_bf16", "amx_bf16")  # lowest first: each needs what the ones below it need
REQUESTS = ("auto", *PATHS)
# the /proc/cpuinfo flags each path needs beyond those of the path below it
_NEEDS = {"avx2": {"avx2", "fma"}, "avx512_bf16": {"avx512_bf16", "avx512bw", "avx512f", "avx512vl", "avx512dq"},
          "amx_bf16": {"amx_bf16", "amx_tile"}}
# the widest vector body a path gives the fused ops (their C++ `max_body` argument): 2 AVX-512, 1 AVX2, 0 scalar
_BODY = {"none": 0, "avx2": 1, "avx512_bf16": 2, "amx_bf16": 2}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where there is no such file or line)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def is_x86(machine: str | None = None) -> bool:
    """Whether `machine` (platform.machine(): x86_64, AMD64, i686, aarch64, arm64, ...) is an x86 CPU."""
    m = (machine if machine is not None else _platform.machine()).lower()
    return m in ("x86_64", "amd64", "x64") or (len(m) == 4 and m[0] == "i" and m.endswith("86"))


def best_path(flags: set[str], machine: str | None = None) -> str:
    """The highest path these flags allow on this machine: none off x86 and on an x86 CPU without AVX2 + FMA."""
    if not is_x86(machine):
        return "none"
    best, needed = "none", set()
    for path in PATHS[1:]:
        needed |= _NEEDS[path]
        if not needed <= flags:
            break
        best = path
    return best


def runnable(flags: set[str], machine: str | None = None) -> list[str]:
    """Every path this CPU can run, lowest first (the tests run each one)."""
    return list(PATHS[:PATHS.index(best_path(flags, machine)) + 1])


def choose(requested: str, flags: set[str], machine: str | None = None) -> str:
    """The path to run for `requested` (auto or a path name); raises ConfigError (one line) for an unknown name or a
    path above what this CPU has."""
    if requested not in REQUESTS:
        raise ConfigError(f"--cpu-isa / CAIRN_CPU_ISA {requested!r}: unknown (choose from {', '.join(REQUESTS)})")
    best = best_path(flags, machine)
    if requested == "auto":
        return best
    if PATHS.index(requested) > PATHS.index(best):
        raise ConfigError(f"--cpu-isa / CAIRN_CPU_ISA {requested}: this CPU's best path is {best} (it lacks "
                          f"{' '.join(sorted(_missing(requested, flags, machine)))}); choose it or a lower one")
    return requested


def _missing(path: str, flags: set[str], machine: str | None) -> set[str]:
    if not is_x86(machine):
        return {f"x86 ({machine or _platform.machine()})"}
    needed = set().union(*(_NEEDS[p] for p in PATHS[1:PATHS.index(path) + 1]))
    return needed - flags


def body(path: str) -> int:
    """The widest vector body the fused ops may run on `path` (their `max_body`): 2 AVX-512, 1 AVX2, 0 scalar."""
    return _BODY[path]


def described(path: str, requested: str, flags: set[str], machine: str | None = None) -> str:
    """The start-up line's account of the path: what was asked, what the CPU has."""
    best = best_path(flags, machine)
    if requested == "auto":
        return f"CPU path: {path} (the best this CPU has; --cpu-isa / CAIRN_CPU_ISA forces a lower one)"
    return f"CPU path: {path} (forced by --cpu-isa / CAIRN_CPU_ISA; this CPU's best is {best})"
