"""Disk-cache faults met by a real `cairn serve`: segments deleted, truncated, bit-flipped, emptied or
replaced by a symlink, while it runs or before it starts, never fail a request, never leak a slot, and
the request's output equals a cold run's. Bad segments are counted in /metrics, moved aside or deleted
(not met again at the next start), and a second server on the same directory resumes what the first
one writes after it started.

The device snapshot budget is tiny so that most snapshots of the first conversations live on disk only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cairn.cache.segments.index import RESCAN_INTERVAL_S
from tests.server_process import REPO_ROOT, start_server
from tests.small_filesystem import fill, small_filesystem

FLAGS = ("--snapshot-interval", "64", "--page-size", "8", "--max-num-seqs", "2", "--device-snapshot-gib", "0.002",
         "--disk-cache-gib", "0.25")  # a budget any test machine has room for: no free-space warning
TOPICS = ("dusk", "dawn", "noon", "night")


def conversation(topic: str) -> list[dict]:
    return [{"role": "system", "content": f"You talk about {topic}. " + "Keep every answer short. " * 6},
            {"role": "user", "content": f"List three colours of the sky at {topic}, please."}]


def follow_up(topic: str) -> list[dict]:
    return conversation(topic) + [{"role": "assistant", "content": "Red, gold, violet."},
                                  {"role": "user", "content": "And which one lasts longest?"}]


def complete(http: httpx.Client, messages: list[dict], cache: bool = True) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "cairn-demo-random", "messages": messages, "max_tokens": 8,
                                                "temperature": 0, "ignore_eos": True, "cache_prompt": cache})
    assert r.status_code == 200, r.text
    return r.json()


def text(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def flip_a_bit(path: Path, _: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def symlink_elsewhere(path: Path, outside: Path) -> None:
    target = outside / path.name
    os.rename(path, target)
    path.symlink_to(target)


DAMAGE = {"delete": lambda p, _: p.unlink(), "truncate": lambda p, _: os.truncate(p, p.stat().st_size // 2),
          "bit_flip": flip_a_bit, "zero_length": lambda p, _: os.truncate(p, 0), "symlink": symlink_elsewhere}


def damage_every_segment(cache: Path, outside: Path) -> int:
    """Each segment file gets one kind of damage, in turn; returns how many were damaged."""
    outside.mkdir(exist_ok=True)
    segments = sorted(cache.glob("*/*.seg"))
    kinds = list(DAMAGE.values())
    for i, path in enumerate(segments):
        kinds[i % len(kinds)](path, outside)
    return len(segments)


def metric(metrics: str, name: str) -> dict[str, float]:
    """{label value: sample} of one labelled counter family in Prometheus text."""
    return {label: float(v) for label, v in re.findall(rf'^{name}{{\w+="(\w+)"}} (\S+)$', metrics, re.M)}


def assert_warm_equals_cold(http: httpx.Client) -> None:
    """Every follow-up (more of them than --max-num-seqs: a slot leaked per failure would hang them) is
    served, and equals the same prompt computed cold."""
    for topic in TOPICS:
        assert text(complete(http, follow_up(topic))) == text(complete(http, follow_up(topic), cache=False))


def test_segments_damaged_while_serving_resume_cold_not_500_and_leak_nothing(tmp_path):
    cache = tmp_path / "cache"
    server = start_server(*FLAGS, "--disk-cache", str(cache))
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for topic in TOPICS:
                complete(http, conversation(topic))
            assert damage_every_segment(cache, tmp_path / "outside") >= len(DAMAGE)
            assert_warm_equals_cold(http)
            assert_warm_equals_cold(http)
            assert http.get("/health").status_code == 200
            metrics = http.get("/metrics").text
    finally:
        server.stop()
    assert sum(metric(metrics, "cairn_cache_disk_faults_total").values()) > 0
    assert metric(metrics, "cairn_cache_disk_segments_forgotten_total").get("disk_unreadable", 0) > 0
    assert "Traceback" not in server.log()


def test_segments_damaged_before_startup_resume_cold_and_are_not_met_again(tmp_path):
    cache = tmp_path / "cache"
    server = start_server(*FLAGS, "--disk-cache", str(cache))
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for topic in TOPICS:
                complete(http, conversation(topic))
    finally:
        assert server.stop() == 0
    damage_every_segment(cache, tmp_path / "outside")
    server = start_server(*FLAGS, "--disk-cache", str(cache))
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            assert_warm_equals_cold(http)
            assert http.get("/health").status_code == 200
    finally:
        assert server.stop() == 0
    assert re.search(r"disk cache \w+: (symlink|truncated|empty): [0-9a-f]{64}\.seg", server.log())
    assert not [p for p in cache.glob("*/*.seg") if p.is_symlink()]
    assert list(cache.glob("*/quarantine/*.seg"))  # the links were moved aside, not followed nor deleted
    server = start_server(*FLAGS, "--disk-cache", str(cache))
    assert server.stop() == 0
    assert "disk cache" in server.log() and not re.search(r"WARNING cairn.cache.disk.store", server.log())


def test_read_only_second_server_resumes_what_the_writer_adds_after_it_started(tmp_path):
    cache = tmp_path / "cache"
    writer = start_server("--snapshot-interval", "64", "--page-size", "8", "--disk-cache", str(cache))
    try:
        reader = start_server("--snapshot-interval", "64", "--page-size", "8", "--disk-cache", str(cache))
        started = time.monotonic()
        try:
            assert "read-only" in reader.log() and "rescan" in reader.log()
            with httpx.Client(base_url=writer.base_url, timeout=60) as http:
                complete(http, conversation(TOPICS[0]))
            time.sleep(max(0.0, RESCAN_INTERVAL_S - (time.monotonic() - started)))
            with httpx.Client(base_url=reader.base_url, timeout=60) as http:
                warm = complete(http, follow_up(TOPICS[0]))
                cold = complete(http, follow_up(TOPICS[0]), cache=False)
        finally:
            reader.stop()
    finally:
        writer.stop()
    assert warm["usage"]["cairn"]["tier"] == "disk" and warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert text(warm) == text(cold)


def test_a_full_disk_fails_no_request_and_keeps_storing_the_new_conversations(tmp_path):
    """The filesystem under --disk-cache fills up (another file grew, and the budget exceeds it): every request
    is served and equals a cold run, the store makes room from its least-recently-used segments (one line), so
    the newest conversation is still stored: after a restart it resumes from disk, as cold serves it."""
    flags = (*FLAGS, "--host-cache-gib", "0", "--disk-cache")
    with small_filesystem(tmp_path / "fs", 24 << 20) as fs:
        server = start_server(*flags, str(fs / "cache"))
        try:
            fill(fs / "other.bin", 7 << 20)  # room for the segments of two or three requests (0.25 GiB budget)
            with httpx.Client(base_url=server.base_url, timeout=60) as http:
                first_turns = [complete(http, conversation(topic)) for topic in TOPICS]
                assert_warm_equals_cold(http)
                metrics = http.get("/metrics").text
        finally:
            assert server.stop() == 0
        restarted = start_server(*flags, str(fs / "cache"))
        try:
            with httpx.Client(base_url=restarted.base_url, timeout=60) as http:
                warm, cold = complete(http, follow_up(TOPICS[-1])), complete(http, follow_up(TOPICS[-1]), cache=False)
        finally:
            assert restarted.stop() == 0
    # resumed from disk past the newest first turn: what was written last, after the disk filled, was kept
    assert warm["usage"]["cairn"]["tier"] == "disk" and text(warm) == text(cold)
    assert warm["usage"]["cairn"]["resume_position"] > first_turns[-1]["usage"]["prompt_tokens"], warm["usage"]
    assert metric(metrics, "cairn_cache_disk_faults_total").get("disk_full", 0) >= 1
    assert metric(metrics, "cairn_cache_disk_store_segments_total")["evictions"] >= 1
    budget = re.search(r"^cairn_cache_disk_budget_bytes (\S+)$", metrics, re.M)  # lowered to what the disk holds
    assert budget and 0 < float(budget.group(1)) < 24 << 20, metrics
    assert server.log().count("is full (No space left on device)") == 1 and "Traceback" not in server.log()


def test_serve_refuses_a_symlinked_disk_cache_with_one_line(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    out = subprocess.run([sys.executable, "-m", "cairn.cli", "serve", "--disk-cache", str(tmp_path / "link"),
                          "--kv-cache-gib", "0.05", "--state-cache-gib", "0.05", "--log-level", "WARNING"],
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2
    link = tmp_path / "link"
    assert out.stderr.strip().splitlines() == [f"cairn serve: error: disk cache {link} is a symbolic link; "
                                               "give the directory it points to"]
    assert list((tmp_path / "real").iterdir()) == []
