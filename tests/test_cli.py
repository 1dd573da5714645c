"""The command line: --help on every command, generate on the demo model, and the disk-cache admin."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cairn.cli import COMMANDS, build_parser, config_from_args
from cairn.config import RANDOM_DEMO_NAME
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]


def cairn(*args: str) -> subprocess.CompletedProcess:
    """`cairn ARGS`; a generate or serve without --model runs the random demo model (its refusals are the flags')."""
    if args and args[0] in ("generate", "serve") and "--model" not in args:
        args = (*args, "--model", RANDOM_DEMO_NAME)
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
    assert row[1] == "cairn-demo-random" and int(row[2]) > 0 and float(row[3]) == pytest.approx(size_mib, abs=0.01)
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


# ---- the first hour: one-line errors before slow work, --version, help -----------------------------

def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_version_prints_the_package_version():
    from cairn import __version__

    out = cairn("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"cairn {__version__}"


def test_hub_id_as_model_is_one_line_saying_how_to_download_it():
    out = cairn("serve", "--model", "Qwen/Qwen3.5-0.8B")
    assert_one_line_error(out, "Qwen/Qwen3.5-0.8B", "hf download Qwen/Qwen3.5-0.8B --local-dir",
                          "--model")


def test_missing_model_directory_is_one_line(tmp_path):
    assert_one_line_error(cairn("generate", "hi", "--model", str(tmp_path / "nowhere")), "no such directory")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.checkpoints import write_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint("qwen3_5_text", path)
    return path


def with_config_key(path, key: str, value) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_quantized_checkpoint_is_one_line_before_loading(checkpoint, tmp_path):
    import shutil

    shutil.copytree(checkpoint, tmp_path / "q")
    with_config_key(tmp_path / "q", "quantization_config", {"quant_method": "fp8"})
    assert_one_line_error(cairn("serve", "--model", str(tmp_path / "q")), "quantized", "fp8")


def test_unsupported_config_key_is_one_line_naming_it(checkpoint, tmp_path):
    import shutil

    shutil.copytree(checkpoint, tmp_path / "k")
    with_config_key(tmp_path / "k", "sliding_window_magic", 7)
    assert_one_line_error(cairn("generate", "hi", "--model", str(tmp_path / "k")), "sliding_window_magic")


def test_port_in_use_is_one_line_before_the_model_loads():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = cairn("serve", "--port", str(port))
    assert_one_line_error(out, f"port {port}", "in use", "--port")
    assert "memory budgets" not in out.stderr  # the engine was never built


@pytest.mark.parametrize("args, needle", [
    (("serve", "--port", "70000"), "--port must be in [0, 65536), got 70000"),
    (("serve", "--max-num-seqs", "0"), "--max-num-seqs must be at least 1, got 0"),
    (("serve", "--snapshot-interval", "-1"), "--snapshot-interval must be at least 0"),
    (("serve", "--kv-cache-gib", "0"), "--kv-cache-gib must be above 0"),
    (("serve", "--device-memory-fraction", "1.5"), "--device-memory-fraction must be in (0, 1], got 1.5"),
    (("serve", "--log-level", "WARNING", "--kv-cache-gib", "1e-9"), "--kv-cache-gib 1e-09 holds no KV page"),
    (("serve", "--log-level", "WARNING", "--prefill-block", "100"), "--prefill-block 100: must be a multiple of 64"),
    (("router", "--replica", "http://127.0.0.1:9", "--port", "70000"), "--port must be in [0, 65536)"),
    (("router", "--replica", "http://127.0.0.1:9", "--probe-timeout-s", "0"), "--probe-timeout-s must be above 0"),
    (("router", "--replica", "http://127.0.0.1:9", "--remembered-prefixes", "-1"), "--remembered-prefixes must be"),
])
def test_out_of_range_flag_is_one_line_naming_it_not_a_traceback(args, needle):
    assert_one_line_error(cairn(*args), needle)


def test_invalid_messages_json_is_one_line():
    assert_one_line_error(cairn("generate", "--messages", "[{"), "--messages")


def test_log_level_and_format_are_accepted_before_and_after_the_subcommand():
    parser = build_parser()
    before = parser.parse_args(["--log-level", "debug", "--log-format", "json", "generate", "hi"])
    after = parser.parse_args(["generate", "hi", "--log-level", "WARNING"])
    neither = parser.parse_args(["generate", "hi"])
    assert (before.log_level, before.log_format) == ("DEBUG", "json")
    assert (after.log_level, after.log_format) == ("WARNING", "text")
    assert neither.log_level is None  # main() picks the command's default (INFO; WARNING for bench)


def help_lines(*command: str) -> list[str]:
    """The entries of `cairn <command> --help`, one option per line (its help text joined to it)."""
    out = subprocess.run([sys.executable, "-m", "cairn.cli", *command, "--help"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "1000"})
    assert out.returncode == 0, out.stderr
    entries: list[str] = []
    for line in out.stdout.split("options:", 1)[1].splitlines():
        text = line.strip()
        if text.startswith("-"):
            entries.append(text)
        elif entries and line.startswith("   ") and text:
            entries[-1] += "  " + text
    return [e for e in entries if e.startswith("--")]


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_help_states_each_default_once_and_every_switch_default(command):
    lines = help_lines(command)
    assert lines
    for line in lines:
        assert "(default: None)" not in line, line
        assert line.count("default:") <= 1 and "by default (default" not in line, line
        if line.startswith("--") and ", --no-" in line.split("  ")[0]:
            assert "(default: on)" in line or "(default: off)" in line, line


def test_bench_flags_do_not_overlap_the_engine_flags():
    flags = {line.split()[0].rstrip(",") for line in help_lines("bench")}
    assert {"--policies", "--workload-seed", "--demo-seed", "--snapshot-min-gap"} <= flags
    assert not flags & {"--seed", "--min-gap-tokens", "--snapshot-policy", "--prefix-cache"}


FLAG_TABLES = {"README.md": "\n## Flags\n", "docs/serving.md": "\n## Every flag of `cairn serve`\n"}


def flag_rows(doc: str) -> dict[str, str]:
    """{flag: its default cell} of `doc`'s flags table (FLAG_TABLES: README.md's has the flags a first run needs,
    docs/serving.md's every flag of `cairn serve`; `--[no-]x` gives --x and --no-x; a row naming two flags, `--host`,
    `--port`, gives each its part of the cell)."""
    table = (REPO_ROOT / doc).read_text().split(FLAG_TABLES[doc], 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `--"):
            cell, default = (c.strip() for c in line.strip("|").split("|")[:2])
            flags = re.findall(r"--(?:\[no-\])?[a-z][a-z0-9-]*", cell)
            defaults = default.split(", ") if len(flags) > 1 else [default]
            for flag, value in zip(flags, defaults, strict=True):
                name = flag.removeprefix("--").removeprefix("[no-]")
                rows |= {f"--{name}": value, f"--no-{name}": value} if "[no-]" in flag else {flag: value}
    return rows


def test_the_serving_document_lists_every_serve_flag():
    flags = {f for line in help_lines("serve") for f in re.findall(r"--[a-z][a-z0-9-]+", line.split("  ")[0])}
    listed = set(flag_rows("docs/serving.md"))
    assert not flags - listed, f"docs/serving.md's flags table does not list: {sorted(flags - listed)}"
    assert not listed - flags, f"docs/serving.md's flags table lists what `cairn serve` lacks: {sorted(listed - flags)}"
    readme = set(flag_rows("README.md"))
    assert not readme - flags, f"README.md's Flags table lists what `cairn serve` lacks: {sorted(readme - flags)}"


@pytest.mark.parametrize("doc", FLAG_TABLES)
def test_the_flag_tables_state_the_defaults_serve_help_gives(monkeypatch, doc):
    monkeypatch.delenv("CAIRN_CPU_ISA", raising=False)  # (a forced-path run sets --cpu-isa's default)
    rows, wrong = flag_rows(doc), []
    for line in help_lines("serve"):
        found = re.search(r"\(default: ([^);]*)[^)]*\)\s*$", line)
        if found and line.split()[0].rstrip(",") in rows:
            stated = found.group(1).removesuffix(".0")
            cell = rows[line.split()[0].rstrip(",")]
            mib = re.fullmatch(r"(\d+) MiB", cell)
            if (str(int(mib.group(1)) << 20) if mib else cell) != stated:
                wrong.append(f"{line.split()[0]}: {doc} {cell!r}, --help {stated!r}")
    assert not wrong, wrong


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


def test_help_and_version_do_not_import_torch():
    """`cairn --help`, `--version` and the one-line refusals build every subcommand's parser; none of that needs
    torch (importing it takes seconds), which only a command that runs a model imports."""
    code = ("import sys, cairn.cli\ncairn.cli.build_parser()\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_package_names_its_api_lazily():
    """`from cairn import LLM, Engine, EngineConfig, SamplingParams` (docs/api.md's example) gives the classes, and
    an unknown name is an AttributeError."""
    import cairn
    from cairn.config import EngineConfig
    from cairn.engine.engine import Engine
    from cairn.engine.llm import LLM
    from cairn.request.sampling_params import SamplingParams

    assert [getattr(cairn, n) for n in cairn.__all__] == [LLM, Engine, EngineConfig, SamplingParams]
    with pytest.raises(AttributeError):
        cairn.Nothing  # noqa: B018


def test_a_refused_serve_flag_is_refused_before_torch_is_imported():
    """`cairn serve --max-num-seqs 0` is a one-line refusal that costs no torch import (seconds a user waits
    for the line): the engine config is checked before the server's modules load."""
    code = ("import sys, cairn.cli\nrc = cairn.cli.main(['serve', '--port', '0', '--max-num-seqs', '0'])\n"
            "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "--max-num-seqs must be at least 1, got 0" in out.stderr
    assert out.stdout.strip() == "2 []"


def test_generate_answers_a_conversation_given_as_messages():
    messages = json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    out = cairn("generate", "--messages", messages, "--max-tokens", "3", "--kv-cache-gib", "0.02", "--log-level",
                "WARNING")
    assert out.returncode == 0, out.stderr
    assert "first token" in out.stderr and "tok/s decode" in out.stderr


def test_an_unknown_device_is_one_line_naming_the_flag():
    """`--device tpu` used to reach torch.device() inside the engine and end in a traceback."""
    assert_one_line_error(cairn("serve", "--device", "tpu"), "--device tpu", "cpu, cuda or cuda:N")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_cuda_device_without_cuda_is_one_line_naming_the_flag():
    """`--device cuda` on a machine torch sees no CUDA device on used to end in torch's AssertionError traceback."""
    assert_one_line_error(cairn("serve", "--log-level", "WARNING", "--device", "cuda"), "--device cuda",
                          "no CUDA device")


def test_a_remote_cache_url_of_another_scheme_is_one_line_before_the_model_loads():
    """`--remote-cache http://...` used to be accepted: the server ran with a remote tier whose every call failed
    (the URL is parsed only when the tier first connects)."""
    out = cairn("serve", "--remote-cache", "http://127.0.0.1:6379/0")
    assert_one_line_error(out, "--remote-cache must be a redis://, rediss:// or redis+cluster:// URL")
    assert "memory budgets" not in out.stderr


@pytest.mark.parametrize("url", ["redis://h:1/0", "rediss://h:1", "redis+cluster://h:1", "rediss+cluster://h:1",
                                 "redis://h:1/0?cluster=true", "REDIS://h:1", "http://h:1", "h:1",
                                 "unix:///tmp/r.sock", ""])
def test_the_remote_cache_flag_accepts_the_urls_the_remote_tier_accepts(url):
    from cairn.cache.remote.client import split_url
    from cairn.config import CacheOptions, ConfigError

    try:
        split_url(url)
        tier_accepts = True
    except ValueError:
        tier_accepts = False
    try:
        CacheOptions(remote_cache=url)
        flag_accepts = True
    except ConfigError:
        flag_accepts = False
    assert flag_accepts == tier_accepts, url


def test_an_empty_served_model_name_is_one_line():
    """`--served-model-name ''` used to be accepted and silently replaced by the engine's model name."""
    assert_one_line_error(cairn("serve", "--served-model-name", ""), "--served-model-name must not be empty")


@pytest.mark.parametrize("layout, needle", [("gemv", "--weight-layout gemv needs bf16 weights on a CPU"),
                                             ("packed", "--weight-layout packed needs bf16 / fp16 weights")])
def test_a_weight_layout_the_dtype_cannot_take_is_one_line(layout, needle):
    """`--weight-layout gemv` (or packed) on the float32 demo model used to end in a ValueError traceback."""
    assert_one_line_error(cairn("serve", "--log-level", "WARNING", "--weight-layout", layout, "--port", "0"), needle)


def test_demo_seed_with_a_checkpoint_is_one_line(checkpoint):
    """`--demo-seed` seeds only the demo model's random weights; beside `--model` it used to be accepted and do
    nothing."""
    out = cairn("serve", "--model", str(checkpoint), "--demo-seed", "3", "--port", "0")
    assert_one_line_error(out, "--demo-seed", "--model")


@pytest.mark.parametrize("field, value, flag", [("disk_cache_gib", 4.0, "--disk-cache-gib"),
                                                 ("disk_compression", "zstd", "--disk-compression"),
                                                 ("disk_cache_create_parents", True, "--disk-cache-create-parents"),
                                                 ("disk_write_through", False, "--no-disk-write-through")])
def test_a_disk_flag_without_a_disk_cache_is_refused(field, value, flag):
    """A disk tier's flag without --disk-cache used to be accepted and do nothing (there is no disk tier)."""
    from cairn.config import CacheOptions, ConfigError

    with pytest.raises(ConfigError, match=f"^{flag} needs --disk-cache"):
        CacheOptions(**{field: value})
    CacheOptions(disk_cache="/somewhere", **{field: value})  # with the tier it is fine


def test_a_disk_budget_of_zero_is_refused_before_the_store_empties_the_cache():
    """--disk-cache-gib 0 was accepted: the disk tier held nothing (every write refused) and the lock holder's
    start-up evicted every segment already stored down to the budget, emptying a cache a restart meant to keep."""
    from cairn.config import CacheOptions, ConfigError

    with pytest.raises(ConfigError, match="^--disk-cache-gib must be above 0, got 0"):
        CacheOptions(disk_cache="/somewhere", disk_cache_gib=0)
    assert_one_line_error(cairn("serve", "--disk-cache", "/nonexistent/x", "--disk-cache-gib", "0"),
                          "--disk-cache-gib must be above 0")


def test_a_disk_flag_without_a_disk_cache_is_one_line():
    assert_one_line_error(cairn("serve", "--disk-compression", "zstd"), "--disk-compression needs --disk-cache")


@pytest.mark.parametrize("origins", ["http://a.example/", "a.example", "http://a.example,ftp:x"])
def test_an_allowed_origin_no_browser_sends_is_refused(origins):
    """A browser's Origin header is scheme://host[:port] with no path: `--allowed-origins http://a.example/` (a
    trailing slash) or a bare host used to be accepted and never match, so every browser call was refused."""
    from cairn.config import ConfigError
    from cairn.server.options import ServerOptions

    with pytest.raises(ConfigError, match="--allowed-origins"):
        ServerOptions(allowed_origins=origins)
    assert ServerOptions(allowed_origins="http://a.example, https://b.example:8443,*").origins == [
        "http://a.example", "https://b.example:8443", "*"]


@pytest.mark.parametrize("flag", ["--queue-cost-s", "--cooldown-s"])
def test_a_negative_router_cost_or_cooldown_is_one_line(flag):
    """`cairn router --queue-cost-s -1` (busier replicas preferred) or `--cooldown-s -1` (a failed replica never
    taken out) used to be accepted."""
    assert_one_line_error(cairn("router", "--replica", "http://127.0.0.1:9", "--port", "0", flag, "-1"),
                          f"{flag} must be at least 0, got -1.0")
