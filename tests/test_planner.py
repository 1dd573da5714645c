"""The resume planner: a pure choice by estimated time to first token across tiers."""

from __future__ import annotations

from cairn.cache.policy.planner import Candidate, Speeds, plan

SPEEDS = Speeds({"device": 10e9, "host": 1e9, "disk": 0.1e9}, prefill_tokens_per_s=1000.0)


def test_deepest_point_wins_when_loading_is_cheap():
    cands = [Candidate(100, "device", {"device": 10_000}), Candidate(900, "host", {"host": 1_000_000})]
    chosen = plan(cands, prompt_len=1000, speeds=SPEEDS)
    assert chosen.position == 900 and chosen.snapshot_tier == "host"
    assert chosen.estimated_s < 0.2


def test_a_shallower_point_wins_when_the_deeper_one_is_too_slow_to_load():
    # 800 more tokens cached on disk, but 400 MB to read at 100 MB/s (4 s) against 0.8 s of prefill
    cands = [Candidate(100, "device", {"device": 10_000}), Candidate(900, "disk", {"disk": 400_000_000})]
    chosen = plan(cands, prompt_len=1000, speeds=SPEEDS)
    assert chosen.position == 100 and chosen.snapshot_tier == "device"
    assert chosen.reasons[900].startswith("slower (disk")


def test_cold_prefill_wins_when_every_load_costs_more():
    chosen = plan([Candidate(10, "disk", {"disk": 50_000_000})], prompt_len=1000, speeds=SPEEDS)
    assert chosen.position == 0 and chosen.snapshot_tier is None and 10 in chosen.reasons


def test_equal_cost_prefers_the_faster_tier():
    speeds = Speeds({"device": 1e9, "host": 1e9, "disk": 1e9}, prefill_tokens_per_s=1000.0)
    cands = [Candidate(500, "disk", {"disk": 1000}), Candidate(500, "host", {"host": 1000})]
    assert plan(cands, 1000, speeds).snapshot_tier == "host"
    cands = [Candidate(500, "device", {"device": 1000}), Candidate(500, "host", {"host": 1000})]
    assert plan(cands, 1000, speeds).snapshot_tier == "device"


def test_kv_on_a_slow_tier_counts_even_when_the_snapshot_is_on_the_device():
    # the snapshot at 800 is on the device but its KV prefix must come from disk
    cands = [Candidate(400, "device", {"device": 1000}),
             Candidate(800, "device", {"device": 1000, "disk": 200_000_000})]
    assert plan(cands, 1000, SPEEDS).position == 400


def test_unusable_deeper_points_are_reported_with_their_reason():
    chosen = plan([Candidate(100, "device", {"device": 1})], 1000, SPEEDS, unusable={700: "evicted", 50: "x"})
    assert chosen.reasons == {700: "evicted"}
