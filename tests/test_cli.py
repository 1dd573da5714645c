"""The command line: --help on every command, generate on the demo model, and the disk-cache admin."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cairn.cli import COMMANDS, build_parser, config_from_args
from cairn.engine import LLM
from cairn.sampling import SamplingParams


def cairn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cairn.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_command_has_help(command):
    out = cairn(*([command] if command else []), "--help")
    assert out.returncode == 0 and "usage: cairn" in out.stdout


def test_engine_flags_build_the_frozen_config():
    ns = build_parser().parse_args(["generate", "hi", "--kv-cache-gib", "0.5", "--no-prefix-cache",
                                    "--snapshot-interval", "256", "--host-cache-gib", "2"])
    cfg = config_from_args(ns)
    assert cfg.memory.kv_cache_gib == 0.5 and cfg.cache.prefix_cache is False
    assert cfg.cache.snapshot_interval == 256 and cfg.cache.host_cache_gib == 2.0
    with pytest.raises(AttributeError):
        cfg.cache.snapshot_interval = 1  # frozen


def test_generate_prints_text_and_timing_on_the_demo_model():
    out = cairn("generate", "Hello", "--max-tokens", "4", "--kv-cache-gib", "0.02", "--log-level", "WARNING")
    assert out.returncode == 0, out.stderr
    assert "first token" in out.stderr and "tok/s decode" in out.stderr


def test_cache_ls_verify_and_purge_a_disk_cache(tmp_path):
    with LLM(disk_cache=str(tmp_path), kv_cache_gib=0.02, state_cache_gib=0.02, snapshot_interval=64) as llm:
        llm.generate(list(range(10, 200)), SamplingParams(max_tokens=3))
    (namespace,) = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    listed = cairn("cache", "ls", "--disk-cache", str(tmp_path))
    assert listed.returncode == 0 and namespace in listed.stdout
    assert cairn("cache", "verify", "--disk-cache", str(tmp_path)).returncode == 0
    victim = next((tmp_path / namespace).glob("*.seg"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    bad = cairn("cache", "verify", "--disk-cache", str(tmp_path))
    assert bad.returncode == 1 and "checksum" in bad.stdout
    foreign = tmp_path / namespace / "notes.txt"
    foreign.write_text("keep me")
    assert cairn("cache", "purge", "--disk-cache", str(tmp_path), "--namespace", namespace).returncode == 0
    assert not list((tmp_path / namespace).glob("*.seg")) and foreign.read_text() == "keep me"
