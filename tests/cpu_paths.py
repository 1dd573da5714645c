"""The CPU instruction paths this machine can run (cairn/ops/cpu_isa.py), for tests that run once per path, and the
/proc/cpuinfo flags of the CPU families cairn meets, for tests that fake a machine.

A test never assumes which CPU it runs on: it takes `PATHS` (every path this machine can run, lowest first: `none`
always, `avx2` on any x86 CPU with AVX2 + FMA, `avx512_bf16` on a Zen 4 or an AMX Xeon, `amx_bf16` on the latter)
or `COMPILED` (the same without `none`) and runs once per path, forcing the lower ones with `cpu_isa=`. A machine
where cairn's C++ ops do not build (no compiler) runs `none` alone, as its engines do.
"""

from __future__ import annotations

from cairn.ops import cpu_gemv, cpu_isa

FLAGS = cpu_isa.cpu_flags()
BUILDS = not isinstance(cpu_gemv.load(FLAGS), str)  # the ops build here (or are built): checked once, by the gemv
PATHS = cpu_isa.runnable(FLAGS) if BUILDS else ["none"]
COMPILED = [p for p in PATHS if p != "none"]
BEST = PATHS[-1]
CPU_BEST = cpu_isa.best_path(FLAGS)  # the best path by the CPU's flags, whether or not the ops build here

# /proc/cpuinfo "flags" of the families cairn meets (the lines as such CPUs print them, cut to what matters here)
_X86 = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "f16c"}
ZEN3 = _X86 | {"avx2", "fma", "bmi2"}  # AMD EPYC Milan: AVX2 + FMA, no AVX-512
ZEN4 = ZEN3 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
               "avx512vbmi"}  # AMD EPYC Genoa: AVX-512 with BF16, no AMX
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"}  # Intel Xeon 4th gen: AMX
ICELAKE = ZEN3 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni"}  # AVX-512, no BF16
OLD_X86 = _X86  # an x86 CPU without AVX2 (or a VM that hides it)
