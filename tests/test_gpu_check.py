"""benchmarks/gpu_check.py, the one prepared GPU check, runs on CPU: its reference-against-reference path.

On a machine without CUDA every fast kernel is the reference, so each kernel row compares the reference
with itself (the same error, a pass), the whole-model check generates the same tokens, and the speed
and compaction-replay rows are written: what a GPU session's one run needs to hold before it starts.
"""

from __future__ import annotations

import json

from benchmarks import gpu_check
from benchmarks.gpu_kernel_cases import CASES


def test_gpu_check_dry_run_compares_reference_with_reference_and_writes_its_json(tmp_path):
    result = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--prefill-len", "32", "--batches", "1",
                             "--decode-tokens", "3"])
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert "| paged decode attention |" in (tmp_path / "gpu_check.md").read_text()
    assert written["errors"] == []
    assert written["fast_kernels"] == "reference" and set(written["imports"]) == set(gpu_check.LIBRARIES)
    rows = written["kernels"]
    assert [r["case"] for r in rows] == list(CASES)
    for row in rows:
        assert row["kernel"] == "reference" and row["pass"] and row["error"] is None
        assert row["fast_err"] == row["ref_bf16_err"] > 0  # the same kernel twice; bf16 against fp32 differs
    [model] = written["models"]
    assert model["tokens_equal"] == model["tokens"] > 0 and model["max_logprob_diff"] == 0.0
    assert [r["side"] for r in written["speed"]] == ["reference", "fast"]
    assert all(r["prefill_tok_s"] > 0 and r["decode_b1_tok_s"] > 0 for r in written["speed"])
    for replay in written["replay"]:
        assert 0 < replay["resumed_at"] < replay["replay_tokens"]  # resumed from a snapshot
    [graphs] = written["graphs"]  # the decode graph path through the checking stand-in, against eager
    assert graphs["backend"].startswith("checking stand-in") and graphs["buckets"][0] == 1
    assert graphs["tokens_equal"] == graphs["tokens"] > 0 and graphs["max_logprob_diff"] < 0.1
    assert graphs["eager_decode_b1_tok_s"] > 0 and graphs["graphs_decode_b1_tok_s"] > 0
    assert "| decode graphs |" in (tmp_path / "gpu_check.md").read_text()
