"""The CPU instruction path (cairn/ops/cpu_isa.py): chosen from the CPU for each family cairn meets, forced lower
by --cpu-isa / CAIRN_CPU_ISA, refused above, and `none` where nothing can be compiled (ARM, no compiler).

The families are faked (their /proc/cpuinfo lines, platform.machine()), so every machine checks every choice;
what the engine does on the paths this machine really runs is checked by the kernel and exactness tests, once
per path (tests/cpu_paths.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from cairn.config import ConfigError, ModelOptions
from cairn.engine.llm import LLM
from cairn.ops import cpu_isa
from tests.cpu_paths import COMPILED, CPU_BEST, ICELAKE, OLD_X86, PATHS, SAPPHIRE_RAPIDS, ZEN3, ZEN4
from tests.server_process import REPO_ROOT

FAMILIES = [(ZEN3, "x86_64", "avx2"), (ZEN4, "x86_64", "avx512_bf16"), (SAPPHIRE_RAPIDS, "x86_64", "amx_bf16"),
            (ICELAKE, "x86_64", "avx2"), (OLD_X86, "x86_64", "none"), (set(), "x86_64", "none"),
            (ZEN4, "AMD64", "avx512_bf16"), (set(), "aarch64", "none"), (ZEN4, "arm64", "none")]
TINY = dict(dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01)


@pytest.mark.parametrize("flags, machine, best", FAMILIES)
def test_each_family_gets_its_best_path_and_every_one_below_it(flags, machine, best):
    assert cpu_isa.best_path(flags, machine) == best
    assert cpu_isa.choose("auto", flags, machine) == best
    assert cpu_isa.runnable(flags, machine) == list(cpu_isa.PATHS[:cpu_isa.PATHS.index(best) + 1])
    for path in cpu_isa.runnable(flags, machine):
        assert cpu_isa.choose(path, flags, machine) == path


@pytest.mark.parametrize("flags, machine, asked", [(ZEN3, "x86_64", "avx512_bf16"), (ZEN4, "x86_64", "amx_bf16"),
                                                   (set(), "aarch64", "avx2"), (ICELAKE, "x86_64", "avx512_bf16")])
def test_a_path_above_the_cpus_best_is_refused_in_one_line_naming_what_it_lacks(flags, machine, asked):
    with pytest.raises(ConfigError) as refused:
        cpu_isa.choose(asked, flags, machine)
    message = str(refused.value)
    assert "\n" not in message and "--cpu-isa / CAIRN_CPU_ISA" in message and "it lacks" in message
    assert ("x86" in message) if machine == "aarch64" else ("avx512_bf16" in message or "amx" in message)


def test_an_unknown_path_is_refused_by_the_config_before_anything_loads():
    with pytest.raises(ConfigError, match="--cpu-isa / CAIRN_CPU_ISA 'avx9': unknown"):
        ModelOptions(cpu_isa="avx9")
    with pytest.raises(ConfigError, match="unknown"):
        cpu_isa.choose("avx9", ZEN4, "x86_64")


@pytest.mark.parametrize("line, flags", [("flags\t\t: fpu avx2 fma avx512f\n", {"fpu", "avx2", "fma", "avx512f"}),
                                         ("Features\t: fp asimd evtstrm aes crc32 atomics\n", set())])
def test_flags_are_read_from_the_cpuinfo_flags_line_and_an_arm_one_has_none(tmp_path, line, flags):
    """x86 Linux names its flags on `flags` lines; ARM on `Features` lines, none of which names an x86 path."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: some CPU\n" + line + "\nprocessor\t: 1\n" + line)
    assert cpu_isa.cpu_flags(str(cpuinfo)) == flags
    assert cpu_isa.cpu_flags(str(tmp_path / "absent")) == set()


def test_the_widest_fused_body_follows_the_path():
    assert [cpu_isa.body(p) for p in cpu_isa.PATHS] == [0, 1, 2, 2]


def test_an_arm_machine_runs_bf16_on_the_reference_kernels_and_builds_nothing(monkeypatch, caplog):
    """aarch64 (Graviton, Apple): the ops are x86 C++, so no build is tried; bf16 serves on the references."""
    monkeypatch.delenv("CAIRN_CPU_ISA", raising=False)  # the path chosen, not one a forced-path run asks for
    monkeypatch.setattr(cpu_isa._platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": set())
    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: pytest.fail("a C++ op was built"))
    with caplog.at_level(logging.INFO):
        llm = LLM(**TINY)
    assert llm.engine.cpu_path == "none" and llm.engine.weight_layout == "plain"
    assert "CPU path: none (the best this CPU has" in caplog.text
    assert len(llm.generate([1, 2, 3])[0].token_ids) > 0


@pytest.mark.parametrize("path", PATHS)
def test_the_engine_runs_the_path_asked_for_and_says_so_in_one_line(path, caplog):
    with caplog.at_level(logging.INFO, logger="cairn.engine"):
        llm = LLM(**TINY, cpu_isa=path)
    assert llm.engine.cpu_path == path
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU path:")]
    assert said == [f"CPU path: {path} (forced by --cpu-isa / CAIRN_CPU_ISA; this CPU's best is {CPU_BEST})"]
    assert f"cairn-cpu-path {path}" in llm.engine.platform  # so exact resumption keeps the paths' states apart
    if path != "none":
        assert {m.kernel.isa for m in llm.engine.model.modules() if hasattr(m, "kernel") and m.kernel} == {path}


@pytest.mark.skipif(CPU_BEST == "amx_bf16", reason="no path above this CPU's best")
def test_the_engine_refuses_a_path_above_this_cpus_best():
    above = cpu_isa.PATHS[cpu_isa.PATHS.index(CPU_BEST) + 1]  # (by its flags: where nothing builds, too)
    with pytest.raises(ConfigError, match=f"--cpu-isa / CAIRN_CPU_ISA {above}: this CPU's best path is"):
        LLM(**TINY, cpu_isa=above)


def test_cairn_cpu_isa_in_the_environment_sets_the_path_of_the_command_line_and_of_llm(monkeypatch):
    from cairn.cli import build_parser
    from cairn.flags import config_from_args

    monkeypatch.setenv("CAIRN_CPU_ISA", "none")
    assert config_from_args(build_parser().parse_args(["serve"])).model.cpu_isa == "none"
    assert config_from_args(build_parser().parse_args(["serve", "--cpu-isa", "auto"])).model.cpu_isa == "auto"
    assert LLM(**TINY).engine.cpu_path == "none"
    assert LLM(**TINY, cpu_isa=PATHS[-1]).engine.cpu_path == PATHS[-1]  # a keyword wins over the environment


@pytest.mark.skipif(not COMPILED, reason="nothing is compiled here anyway")
def test_without_a_compiler_bf16_serves_on_the_reference_kernels_after_one_log_line(tmp_path):
    """A machine with no C++ compiler (and nothing built yet): the engine finds the build failing once, says so
    in one warning, runs the path none, and no other op tries to build (a fresh process: builds are cached)."""
    script = ("import logging\n"
              "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(name)s: %(message)s')\n"
              "from cairn.engine.llm import LLM\n"
              f"llm = LLM(**{TINY!r})\n"
              "print('path', llm.engine.cpu_path, llm.engine.weight_layout)\n"
              "print('tokens', len(llm.generate([1, 2, 3])[0].token_ids))\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    env.pop("CAIRN_CPU_ISA", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert "path none plain" in done.stdout and "tokens " in done.stdout
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "CPU path: none, the PyTorch reference kernels (building the kernel failed" in \
        warnings[0], done.stderr
