"""`cairn bench` as a user runs it: the command line (`python -m cairn.bench`) against a real `cairn serve`
(--url), and its refusals, each one line or one message naming what to do, never a traceback.

test_bench.py checks the figures of an in-process run through `bench()`; here the paths around it run:
the command line's own entry, the HTTP runner's client made from --url with the server's model name, the
restart workload skipped over HTTP (and its target reported so), the per-request tables, and the missing
extras (matplotlib for --plots, transformers for --size) named with the pip command that installs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cairn.bench.cli import BenchOptions, _plot_all, bench
from cairn.bench.http_runner import HTTPRunner
from cairn.bench.run import run_workload
from cairn.bench.workloads import all_workloads
from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.request.tokenizer import ByteTokenizer
from cairn.server.app import create_app
from cairn.server.options import ServerOptions
from tests.scripted_replica import Script, ScriptedReplica
from tests.server_process import REPO_ROOT, start_server
from tests.test_bench import SIZES

CONFIG = config_with_overrides(EngineConfig(), kv_cache_gib=0.02, state_cache_gib=0.02)


def bench_command(*flags: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cairn.bench", *flags], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def test_bench_over_http_runs_the_workloads_on_a_real_server_and_skips_the_restart(tmp_path):
    server = start_server()
    try:
        done = bench_command("--url", server.base_url, "--workloads", "edit,restart", "--no-plots", "--verbose",
                             "--out", str(tmp_path))
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["target"] == server.base_url and record["policies"] == ["server"]
    assert record["command"].startswith("cairn bench --url")
    edit, restart = record["results"]
    labels = [r["label"] for r in edit["requests"]]
    assert labels[0] == "original" and labels[2:] == ["regenerate", "continue"]
    assert sum(r["cached_tokens"] for r in edit["requests"]) > 0  # the server's cache answered
    assert "cannot restart the server" in restart["skipped"] and restart["requests"] == []
    assert "edit / server" in done.stdout and "| original |" in done.stdout  # the per-request table
    assert "restart / server: skipped" in done.stdout
    assert any("skipped" in t["note"] for t in record["targets"] if t["workload"] == "restart")


def test_an_unknown_workload_is_one_line_naming_the_flag(tmp_path):
    done = bench_command("--workloads", "edit,nope", "--out", str(tmp_path), timeout_s=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("cairn bench: error: --workloads: unknown ['nope']; known: ")


def test_size_and_model_together_are_refused_before_anything_runs(tmp_path):
    base = config_with_overrides(CONFIG, model=str(tmp_path))
    with pytest.raises(SystemExit, match="give --size or --model, not both"):
        bench(BenchOptions(size="tiny", out=str(tmp_path / "out")), base)
    assert not (tmp_path / "out").exists()


def test_a_missing_bench_extra_is_named_with_its_install_command(tmp_path, monkeypatch):
    """matplotlib (--plots) and transformers (--size) are the `bench` extra: without them the run stops with
    the pip command, not an ImportError traceback."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ModuleNotFoundError
    with pytest.raises(SystemExit, match=r"needs transformers .*pip install 'cairn\[bench\]'"):
        bench(BenchOptions(size="tiny", checkpoint_dir=str(tmp_path / "tiny"), out=str(tmp_path / "out")), CONFIG)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "cairn.bench.plots", raising=False)
    with pytest.raises(SystemExit, match=r"plots need matplotlib .*--no-plots"):
        _plot_all([], tmp_path, "cairn")


def test_an_http_run_refused_by_the_server_names_the_request_and_the_status():
    """A model name the server does not serve (--server-model) is its 404, raised with the request's label."""
    with TestClient(create_app(Engine(CONFIG), ServerOptions())) as client:
        runner = HTTPRunner("http://testserver", ByteTokenizer(), model="nope", client=client)
        with pytest.raises(RuntimeError, match=r"^original: HTTP 404: .*model_not_found"):
            run_workload(all_workloads()["edit"], "server", lambda: runner, SIZES, seed=0)


def test_a_bench_whose_every_workload_is_skipped_reports_it_and_draws_no_plot(tmp_path):
    """Over --url the restart workload is skipped before any request: the run still ends with its report
    and record (nothing to plot, no empty figure), and `python -m cairn.bench.plots` redraws nothing."""
    done = bench_command("--url", "http://127.0.0.1:9", "--workloads", "restart", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "| restart | - | - | - | skipped |" in done.stdout
    assert "restart / server" not in done.stdout  # the progress lines are --verbose's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "report.md"]
    redrawn = subprocess.run([sys.executable, "-m", "cairn.bench.plots", str(tmp_path)], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
    assert redrawn.returncode == 0 and redrawn.stdout.strip() == "", redrawn.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "report.md"]


def test_an_http_run_with_another_tokenizer_than_the_servers_says_to_pass_tokenizer(tmp_path):
    """The bench counts prompt tokens with its own tokenizer (the oracle needs them): one that is not the
    server's would make every figure wrong, so the first request whose count differs stops the run."""
    from cairn.bench.checkpoint import CHATML
    from cairn.request.tokenizer import HFTokenizer
    from tests.test_chat_templates import write_checkpoint_tokenizer

    write_checkpoint_tokenizer(tmp_path, CHATML.replace("<|im_start|>", "<|im_start|> "))  # not the demo's count
    with TestClient(create_app(Engine(CONFIG), ServerOptions())) as client:
        runner = HTTPRunner("http://testserver", HFTokenizer(tmp_path), model="cairn-demo-random", client=client)
        with pytest.raises(RuntimeError, match=r"^original: the server counted \d+ prompt tokens, the local "
                                               r"tokenizer \d+: pass --tokenizer"):
            run_workload(all_workloads()["edit"], "server", lambda: runner, SIZES, seed=0)


def test_a_bench_on_a_machine_without_git_records_the_commit_as_unknown(tmp_path):
    """An installed cairn run where `git` is not on PATH: the record's environment says so instead of failing."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # the interpreter's directory: no git there
    done = subprocess.run([sys.executable, "-m", "cairn.bench", "--url", "http://127.0.0.1:9", "--workloads",
                           "restart", "--no-plots", "--out", str(tmp_path)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "record.json").read_text())["environment"]["git"] == "unknown"
    assert "commit unknown" in done.stdout


def failing_sample(*args, **kwargs):
    raise RuntimeError("injected sampling fault")


def test_an_in_process_request_the_engine_fails_stops_the_run_naming_it(monkeypatch):
    """A request the engine finishes with an error (here its sampling raises, as an out-of-memory would)
    ends the run with the request's label and the engine's reason, not with a figure for it."""
    from cairn.bench.engine_runner import EngineRunner
    from cairn.request import sampling

    runner = EngineRunner(CONFIG)  # (its warm-up request samples before the fault)
    monkeypatch.setattr(sampling, "sample", failing_sample)
    with pytest.raises(RuntimeError, match=r"^original: the engine failed the request: sampling failed: "
                                           r"RuntimeError: injected sampling fault"):
        run_workload(all_workloads()["edit"], "cairn", lambda: runner, SIZES, seed=0)


def test_an_http_request_the_server_fails_mid_stream_stops_the_run_naming_it(monkeypatch):
    """The server's last event is an error (its engine step failed after the answer began): the run stops
    with the request's label and the server's message."""
    engine = Engine(CONFIG)
    with TestClient(create_app(engine, ServerOptions())) as client:
        runner = HTTPRunner("http://testserver", ByteTokenizer(), client=client)
        real_step, calls = engine.step, [0]

        def step():
            calls[0] += 1
            if calls[0] == 2:  # the first token has been streamed
                raise RuntimeError("injected step fault")
            return real_step()

        monkeypatch.setattr(engine, "step", step)
        with pytest.raises(RuntimeError, match=r"^original: the server failed the request: .*injected step fault"):
            run_workload(all_workloads()["edit"], "server", lambda: runner, SIZES, seed=0)


def test_an_http_run_against_a_server_that_sends_no_usage_says_so():
    """The figures need the stream's usage (prompt tokens, cached tokens): a server that ignores
    `stream_options.include_usage` stops the run at its first request with that reason."""
    with ScriptedReplica(Script(answer="stream_without_usage")) as server:
        runner = HTTPRunner(server.url, ByteTokenizer())
        with pytest.raises(RuntimeError, match=r"^original: the stream ended without usage$"):
            run_workload(all_workloads()["edit"], "server", lambda: runner, SIZES, seed=0)
