"""`cairn bench`: a smoke run of every workload under every policy on the demo model, checked for sanity.

The run is small (seconds); nothing here checks speed. It checks what must hold whatever the timing:
the oracle bounds every request's reuse, the no-cache policy reuses nothing, cairn reuses at least
as much as every baseline where divergence is far back or between conversations, the record has its
documented fields, the plots exist, the workloads are deterministic, and an HTTP run reports what
the in-process run does.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cairn.bench import checkpoint as bench_checkpoint
from cairn.bench.cli import BenchOptions, bench
from cairn.bench.conversation import Reply, WorkloadSizes
from cairn.bench.engine_runner import EngineRunner
from cairn.bench.http_runner import HTTPRunner
from cairn.bench.oracle import oracle_tokens
from cairn.bench.policies import POLICIES
from cairn.bench.record import REPLAY_LABEL, BenchRecord, RequestRecord, WorkloadResult, evaluate_targets
from cairn.bench.report import targets_table
from cairn.bench.run import run_workload
from cairn.bench.sessions import client_keeps
from cairn.bench.text import TextSource
from cairn.bench.workloads import all_workloads
from cairn.cli import build_parser
from cairn.config import EngineConfig, config_with_overrides
from cairn.request.tokenizer import ByteTokenizer
from cairn.server.app import create_app
from cairn.server.options import ServerOptions

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZES = WorkloadSizes(system_tokens=32, message_tokens=20, reply_tokens=2, compaction_context_tokens=320,
                      keep_fraction=0.55, instruction_tokens=8, agentic_turns=5, tool_result_tokens=20,
                      interleave_tokens=128, shared_fractions=(0.0, 0.4, 0.6), edit_context_tokens=160, num_users=2,
                      user_tokens=16, restart_turns=4)
CONFIG = config_with_overrides(EngineConfig(), kv_cache_gib=0.02, state_cache_gib=0.02, device_snapshot_gib=0.02,
                               max_num_batched_tokens=192, snapshot_interval=128, snapshot_min_gap=64)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[BenchRecord, dict]:
    out = tmp_path_factory.mktemp("bench")
    opts = BenchOptions(out=str(out), threads=1)
    record = bench(opts, CONFIG, command="pytest", sizes=SIZES)
    return record, json.loads((out / "record.json").read_text())


def ran(record: BenchRecord) -> list[WorkloadResult]:
    return [r for r in record.results if not r.skipped]


def result(record: BenchRecord, workload: str, policy: str) -> WorkloadResult:
    return next(r for r in record.results if r.workload == workload and r.policy == policy)


# ---- the oracle ----------------------------------------------------------------------------------------

def test_oracle_is_the_longest_common_prefix_with_any_earlier_full_sequence_capped_below_the_prompt():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 5, 6, 7], [1, 2, 8], [1, 2, 8]]
    fulls = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 0], [1, 2, 3, 4, 5, 6, 7, 1], [1, 2, 8, 3], [1, 2, 8, 3]]
    # 0: nothing before; 1: shares [1..4] with 0; 2: shares [1..6] with 0's generated tokens;
    # 3: shares [1, 2] but must compute one token; 4: the identical prompt was served before
    assert oracle_tokens(prompts, fulls) == [0, 4, 6, 2, 3]


def test_oracle_of_a_prompt_entirely_inside_an_earlier_sequence_leaves_one_token_to_compute():
    assert oracle_tokens([[5, 6, 7, 8], [5, 6]], [[5, 6, 7, 8, 9], [5, 6, 1]]) == [0, 1]


# ---- the workloads -------------------------------------------------------------------------------------

def requests_of(name: str, seed: int, reply: str = "thinking... answer") -> list:
    tokenizer = ByteTokenizer()
    stream = all_workloads()[name].build(SIZES, TextSource(seed, tokenizer), tokenizer)
    out = [next(stream)]
    for _ in range(1000):
        try:
            out.append(stream.send(Reply(reply)))
        except StopIteration:
            return out
    raise AssertionError("the workload never ends")


@pytest.mark.parametrize("name", list(all_workloads()))
def test_workloads_are_deterministic_from_the_seed(name):
    assert requests_of(name, 1) == requests_of(name, 1)
    assert requests_of(name, 1) != requests_of(name, 2)


def test_compaction_replays_the_conversation_cut_at_a_message_boundary_plus_an_instruction():
    conversation, replay = requests_of("compaction", 0)
    k = len(replay.messages) - 1
    assert replay.messages[:k] == conversation.messages[:k] and k < len(conversation.messages)
    assert replay.messages[-1]["role"] == "user" and replay.messages[-1]["content"].startswith("Compact")


def test_agentic_session_keeps_replies_without_their_reasoning_and_compacts_at_two_thirds():
    reqs = requests_of("agentic", 0, reply="REASONING answer")
    assert len(reqs) == SIZES.agentic_turns
    assert [i for i, r in enumerate(reqs) if "compaction" in r.label] == [2 * SIZES.agentic_turns // 3]
    kept = [m["content"] for m in reqs[1].messages if m["role"] == "assistant"]
    assert kept == [client_keeps("REASONING answer")] and "REASONING" not in kept[0]


def test_restart_workload_restarts_once_halfway():
    assert [r.restart_before for r in requests_of("restart", 0)] == [i == SIZES.restart_turns // 2
                                                                     for i in range(SIZES.restart_turns)]


# ---- the smoke run -------------------------------------------------------------------------------------

def test_every_workload_ran_under_every_policy(run):
    record, _ = run
    assert {(r.workload, r.policy) for r in record.results} == {(w, p) for w in all_workloads() for p in POLICIES}
    assert all(r.requests for r in ran(record))


def test_oracle_bounds_every_request(run):
    record, _ = run
    for r in ran(record):
        for x in r.requests:
            assert 0 <= x.cached_tokens <= x.oracle_tokens <= x.prompt_tokens, (r.workload, r.policy, x)
            assert x.computed_tokens == x.prompt_tokens - x.cached_tokens
            assert x.resume_position == x.cached_tokens and x.output_tokens == SIZES.reply_tokens


def test_reuse_ratio_is_in_the_unit_interval(run):
    record, _ = run
    for r in ran(record):
        assert 0.0 <= r.totals()["reuse_of_oracle"] <= 1.0


def test_no_cache_policy_reuses_nothing(run):
    record, _ = run
    assert all(x.cached_tokens == 0 for r in ran(record) if r.policy == "none" for x in r.requests)


@pytest.mark.parametrize("workload", ["compaction", "interleave"])
def test_cairn_reuses_at_least_as_much_as_every_baseline(run, workload):
    record, _ = run
    cairn = result(record, workload, "cairn").totals()["cached_tokens"]
    for policy in POLICIES:
        assert cairn >= result(record, workload, policy).totals()["cached_tokens"], policy
    assert result(record, "compaction", "cairn").totals()["reuse_of_oracle"] > 0.9


def test_restart_runs_with_the_disk_tier(run):
    record, _ = run
    restart = result(record, "restart", "cairn")
    assert restart.skipped is None and restart.requests[SIZES.restart_turns // 2].restarted_before


def test_json_record_has_the_documented_fields(run):
    _, data = run
    assert set(data) == {f.name for f in dataclasses.fields(BenchRecord)}
    assert data["schema"] == "cairn-bench/1" and data["policies"] == list(POLICIES)
    for r in data["results"]:
        assert set(r) == {f.name for f in dataclasses.fields(WorkloadResult)} | {"totals"}
        assert set(r["totals"]) == {"num_requests", "prompt_tokens", "cached_tokens", "computed_tokens",
                                    "oracle_tokens", "reuse_of_oracle", "ttft_total_s", "ttft_mean_s"}
        for x in r["requests"]:
            assert set(x) == {f.name for f in dataclasses.fields(RequestRecord)}
    assert {t["workload"] for t in data["targets"]} == {"compaction", "agentic", "interleave", "restart"}
    assert all(set(t) >= {"name", "policy", "value", "threshold", "met"} for t in data["targets"])


def test_snapshot_map_of_the_agentic_session_lists_tiers_and_sources(run):
    record, _ = run
    points = result(record, "agentic", "cairn").snapshots
    assert points and all(p.tier in ("device", "host", "disk") and p.source for p in points)
    assert result(record, "agentic", "none").snapshots == []


def test_plots_exist_and_are_non_empty_pngs(run):
    record, data = run
    names = sorted(p.rsplit("/", 1)[-1] for p in data["plots"])
    assert names == ["reuse.png", "snapshots_agentic.png", "ttft_agentic.png"]
    for path in data["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_record_gives_back_the_results_it_plots(run):
    from cairn.bench.plots import results_from_record

    record, data = run
    assert results_from_record(data) == record.results


def test_the_plots_are_drawn_again_from_the_record_alone(run, tmp_path):
    """`python -m cairn.bench.plots DIR` redraws the plots from DIR/record.json (after a change to the plots,
    without running the benchmark again)."""
    _, data = run
    shutil.copy(Path(data["plots"][0]).parent / "record.json", tmp_path / "record.json")
    done = subprocess.run([sys.executable, "-m", "cairn.bench.plots", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    drawn = done.stdout.split()
    assert sorted(Path(p).name for p in drawn) == sorted(Path(p).name for p in data["plots"])
    for path in drawn:
        assert Path(path).parent == tmp_path and Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_is_a_cairn_command():
    ns = build_parser().parse_args(["bench", "--workloads", "edit", "--policies", "none,cairn", "--size", "demo"])
    assert ns.command == "bench" and ns.workloads == "edit" and ns.kv_cache_gib is None  # sized at start-up


def test_bench_without_flags_is_the_published_smoke_run():
    ns = build_parser().parse_args(["bench"])
    assert (ns.preset, ns.size, ns.workloads, ns.policies) == ("smoke", "demo", "all", "all")
    assert (ns.threads, ns.max_num_batched_tokens, ns.snapshot_min_gap) == (1, 256, 256)
    assert "cairn bench --out benchmarks/figures/cairn-bench-demo\n" in (REPO_ROOT / "BENCHMARKS.md").read_text()


def test_bench_size_makes_its_checkpoint_from_the_package_alone(tmp_path):
    """--size writes random weights with cairn.bench.checkpoint and runs on them; it no longer puts the
    source checkout on sys.path to borrow benchmarks/engine_throughput.py."""
    path_before = list(sys.path)
    opts = BenchOptions(size="tiny", checkpoint_dir=str(tmp_path / "tiny"), workloads="edit", policies="cairn",
                        out=str(tmp_path / "out"), plots=False)
    record = bench(opts, CONFIG, command="pytest", sizes=SIZES)
    assert sys.path == path_before
    assert record.model == str(tmp_path / "tiny") and record.size == "tiny"
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["hidden_size"] == 256
    assert [len(r.requests) for r in record.results] == [4]  # the edit workload: original, edit, regenerate, continue


# ---- over HTTP -------------------------------------------------------------------------------------------

@pytest.fixture
def one_thread():
    """One torch thread, as the bench's own runs use (two oversubscribe a shared 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_an_http_run_reports_what_the_in_process_run_does(one_thread):
    from cairn.engine.engine import Engine

    config = dataclasses.replace(CONFIG, cache=dataclasses.replace(CONFIG.cache, snapshot_policy="cairn"))
    workload = all_workloads()["edit"]
    local = run_workload(workload, "cairn", lambda: EngineRunner(config), SIZES, seed=3)
    with TestClient(create_app(Engine(config), ServerOptions())) as client:
        remote = run_workload(workload, "server", lambda: HTTPRunner("http://testserver", ByteTokenizer(),
                                                                     client=client), SIZES, seed=3)
    fields = ("prompt_tokens", "cached_tokens", "resume_position", "resume_source", "match_length")
    assert [[getattr(x, f) for f in fields] for x in remote.requests] == \
        [[getattr(x, f) for f in fields] for x in local.requests]
    assert all(x.cached_tokens <= x.oracle_tokens for x in remote.requests)
    assert sum(x.cached_tokens for x in remote.requests) > 0


FAMILY_BY_PREFIX = {"nemotron-h": "nemotron_h", "falcon-h1": "falcon_h1", "granite": "granitemoehybrid"}


@pytest.mark.parametrize("size", bench_checkpoint.SIZES)
def test_every_bench_size_is_a_config_cairn_loads_as_its_family(size):
    """`cairn bench --size` (and the benchmarks) write random weights from these configs: each must be
    one cairn's families accept (as config.json is saved), of the family its name says."""
    from cairn.model.families import config_from_hf

    hf = bench_checkpoint.hf_config(size)
    config = config_from_hf(json.loads(hf.to_json_string()))  # what save_pretrained writes
    family = next((f for prefix, f in FAMILY_BY_PREFIX.items() if size.startswith(prefix)), "qwen3_5")
    assert config.family == family
    assert len(config.layer_types) == hf.num_hidden_layers and config.vocab_size == hf.vocab_size
    assert config.recurrent_layers


def test_the_skeleton_size_has_the_layers_of_the_size_it_mirrors():
    """0.8b-skeleton measures what a 0.8b decode step costs besides arithmetic and memory traffic (decode_profile.py):
    it must have the 0.8b's layers, kinds and order, only narrower."""
    from cairn.model.families import config_from_hf

    full, skeleton = (config_from_hf(json.loads(bench_checkpoint.hf_config(s).to_json_string()))
                      for s in ("0.8b", "0.8b-skeleton"))
    assert skeleton.layer_types == full.layer_types and skeleton.family == full.family
    assert skeleton.hidden_size < full.hidden_size and skeleton.vocab_size < full.vocab_size


def _request(label: str, prompt: int, cached: int, oracle: int, ttft_s: float, miss: str | None = None):
    return RequestRecord(index=0, label=label, conversation="main", prompt_tokens=prompt, cached_tokens=cached,
                         computed_tokens=prompt - cached, oracle_tokens=oracle, resume_position=cached,
                         resume_tier="device" if cached else None, resume_source=None, match_length=oracle,
                         miss_reason=miss, snapshots_taken=0, output_tokens=1, ttft_s=ttft_s)


def test_a_missed_target_says_in_one_line_where_its_shortfall_comes_from():
    results = [
        WorkloadResult("compaction", "none", [_request(REPLAY_LABEL, 1000, 0, 900, 1.0)]),
        WorkloadResult("compaction", "cairn", [_request(REPLAY_LABEL, 1000, 900, 900, 0.2)]),
        WorkloadResult("agentic", "cairn", [_request("turn 0", 100, 0, 0, 0.1),
                                            _request("turn 1", 200, 40, 190, 0.1, miss="evicted")]),
    ]
    targets = {t.workload: t for t in evaluate_targets(results, "cairn")}
    assert targets["compaction"].met is False and targets["agentic"].met is False
    assert "computed 100 of 1000 tokens in 0.200 s" in targets["compaction"].note
    assert "'turn 1': 40 of 190" in targets["agentic"].note and "evicted" in targets["agentic"].note
    record = BenchRecord("s", "", "", "engine", "m", "demo", "smoke", 0, 0, {}, {}, ["none", "cairn"], [], {},
                         results, list(targets.values()))
    missed = [line for line in targets_table(record).splitlines() if line.startswith("- ")]
    assert len(missed) == 2 and all("missed: " in line for line in missed)
