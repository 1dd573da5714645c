"""The operator's log: a line per finished request, periodic stats, the access log, JSON logs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import httpx

from cairn.engine.activity import ActivityLog
from cairn.engine.llm import LLM
from cairn.logs import JsonFormatter, setup_logging
from cairn.request.sampling_params import SamplingParams
from tests.server_process import REPO_ROOT, start_server

OPTS = dict(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, snapshot_interval=32)


def steady(llm: LLM) -> LLM:
    """Pin the device copy speed the planner uses: its start-up measurement of one 0.4 MiB slot can read
    a few MB/s on a loaded machine, which makes any restore look slower than recomputing a short prompt."""
    llm.engine.cache.speeds.bandwidth["device"] = 1e9
    return llm


def finished_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "request_finished"]


def test_a_finished_request_logs_one_line_with_tokens_cache_ttft_speed_and_reason(caplog):
    prompt = list(range(10, 110))
    with caplog.at_level(logging.INFO, logger="cairn.engine"), steady(LLM(**OPTS)) as llm:
        llm.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        llm.generate(prompt + [7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    cold, warm = finished_lines(caplog)
    assert cold.fields["prompt_tokens"] == 100 and cold.fields["output_tokens"] == 5
    assert cold.fields["cached_tokens"] == 0 and cold.fields["finish_reason"] == "length"
    assert cold.fields["ttft_s"] > 0 and cold.fields["decode_tok_per_s"] > 0
    assert warm.fields["cached_tokens"] > 0 and warm.fields["resume_tier"] == "device"
    assert f"cached {warm.fields['cached_tokens']} from device" in warm.getMessage()
    assert "finish length" in warm.getMessage() and "\n" not in warm.getMessage()


def test_no_finished_line_with_log_requests_off(caplog):
    with caplog.at_level(logging.INFO, logger="cairn.engine"), LLM(**OPTS, log_requests=False) as llm:
        llm.generate([5, 6, 7], SamplingParams(max_tokens=2))
    assert not finished_lines(caplog)


def test_stats_line_while_busy_reports_load_speed_cache_hits_per_tier_and_pool_use(caplog):
    prompt = list(range(10, 110))
    with caplog.at_level(logging.INFO, logger="cairn.engine"), steady(LLM(**OPTS, log_stats_interval_s=1e-9)) as llm:
        llm.generate(prompt, SamplingParams(max_tokens=2))
        llm.generate(prompt + [1, 2], SamplingParams(max_tokens=2))
    stats = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("event") == "stats"]
    assert stats
    warm = next(s for s in stats if s["cache_hit_rate"])
    assert set(warm["cache_hit_rate_by_tier"]) == {"device"} and 0 < warm["cache_hit_rate"] <= 1
    assert {"running", "waiting", "generation_tok_per_s", "kv_pool_use", "working_slots_use",
            "device_snapshots_use"} <= set(warm)


def test_stats_line_is_written_at_most_once_per_interval_and_only_when_busy(caplog):
    now = [0.0]
    activity = ActivityLog(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="cairn.engine"):
        activity.token()
        now[0] = 5.0
        activity.maybe_stats(dict, 1, 0)  # too soon
        now[0] = 10.0
        activity.maybe_stats(dict, 1, 0)  # due
        now[0] = 25.0
        activity.maybe_stats(dict, 0, 0)  # idle since: nothing to say
    assert [r.fields["generation_tok_per_s"] for r in caplog.records] == [0.1]


def test_json_formatter_writes_one_object_with_the_records_fields():
    record = logging.LogRecord("cairn.engine", logging.INFO, __file__, 1, "finished %s", ("req-1",), None)
    record.fields = {"event": "request_finished", "cached_tokens": 3}
    obj = json.loads(JsonFormatter().format(record))
    assert obj["msg"] == "finished req-1" and obj["level"] == "INFO" and obj["cached_tokens"] == 3


def test_log_format_json_makes_every_log_line_a_json_object():
    out = subprocess.run([sys.executable, "-m", "cairn.cli", "--log-format", "json", "generate", "Hi", "--max-tokens",
                          "3", "--kv-cache-gib", "0.02"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    logged = [line for line in out.stderr.splitlines() if not line.startswith("[cairn-demo]")]  # the timing print
    objects = [json.loads(line) for line in logged]
    assert any(o.get("event") == "request_finished" and o["output_tokens"] == 3 for o in objects)


def test_server_logs_access_and_finished_lines_by_default():
    server = start_server()
    try:
        r = httpx.post(server.base_url + "/v1/completions", json={"model": "cairn-demo-random", "prompt": "Hello",
                                                                  "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        httpx.get(server.base_url + "/health", timeout=10)
    finally:
        server.stop()
    log = server.log()
    assert "POST /v1/completions 200" in log and "cairn.access" in log
    assert "GET /health" not in log  # probes are logged at DEBUG
    assert "finished " in log and "finish length" in log


def test_json_log_line_of_an_exception_carries_its_traceback_in_the_same_object():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("cairn.server", logging.ERROR, __file__, 1, "request failed", (), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line  # one line per record, even with a multi-line traceback
    obj = json.loads(line)
    assert obj["msg"] == "request failed" and "Traceback" in obj["exc"] and "ValueError: boom" in obj["exc"]


def test_httpx_request_lines_such_as_the_router_health_polls_are_logged_at_debug_only():
    """`cairn router` polls each replica's /health every 2 s through httpx, which logs every request it sends
    at INFO: at the default level those lines (and the probes' and forwarded requests') are not written."""
    httpx_log = logging.getLogger("httpx")
    setup_logging("INFO")
    assert not httpx_log.isEnabledFor(logging.INFO) and httpx_log.isEnabledFor(logging.WARNING)
    setup_logging("DEBUG")
    assert httpx_log.isEnabledFor(logging.INFO)


def test_an_access_line_escapes_the_control_characters_of_a_percent_decoded_path(caplog):
    """`GET /%0a2026-12-03 INFO cairn.engine: ...` arrives decoded: the text log held a forged second line."""
    import asyncio

    from cairn.server.http.access_log import AccessLog

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": "GET", "path": "/\nforged INFO line\x1b[2J", "client": ("1.2.3.4", 5)}
    with caplog.at_level(logging.INFO, logger="cairn.access"):
        asyncio.run(AccessLog(app)(scope, receive, send))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "cairn.access"]
    assert line == "1.2.3.4 GET /\\x0aforged INFO line\\x1b[2J 404 " + line.split(" 404 ")[1]
    assert "\n" not in line and "\x1b" not in line
