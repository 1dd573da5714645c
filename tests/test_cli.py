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
    assert listed.returncode == 0
    row = next(line.split() for line in listed.stdout.splitlines() if line.startswith(namespace[:16]))
    size_mib = sum(p.stat().st_size for p in (tmp_path / namespace).glob("*.seg")) / 2**20
    assert row[1] == "cairn-demo" and int(row[2]) > 0 and float(row[3]) == pytest.approx(size_mib, abs=0.01)
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


def test_cache_verify_accepts_the_short_namespace_id_of_the_startup_log(tmp_path):
    with LLM(disk_cache=str(tmp_path), kv_cache_gib=0.02, state_cache_gib=0.02, snapshot_interval=64) as llm:
        llm.generate(list(range(10, 100)), SamplingParams(max_tokens=2))
    (namespace,) = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    out = cairn("cache", "verify", "--disk-cache", str(tmp_path), "--namespace", namespace[:16])
    assert out.returncode == 0 and out.stdout.startswith(f"{namespace[:16]}: ") and " ok, 0 bad" in out.stdout
    unknown = cairn("cache", "verify", "--disk-cache", str(tmp_path), "--namespace", "f00d")
    assert unknown.returncode == 1 and "no namespace 'f00d'" in unknown.stderr


@pytest.mark.parametrize("action", ["verify", "ls"])
def test_cache_admin_on_a_missing_directory_fails_with_one_line(tmp_path, action):
    out = cairn("cache", action, "--disk-cache", str(tmp_path / "missing"))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == f"cairn cache {action}: {tmp_path / 'missing'} is not a directory"
