"""cairn's models against transformers on the same tiny random checkpoints (fp32).

Each family and on-disk layout of tests/checkpoints.py FAMILIES: one-pass prefill logits, prefill chunked
at arbitrary points, greedy generation (and where it stops: generation_config.json's eos_token_id), batched
decode, and resuming from a copied recurrent state.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cairn.engine.llm import LLM
from cairn.layers import recurrent
from cairn.model.loader import load_checkpoint
from cairn.request.sampling_params import SamplingParams
from tests.checkpoints import FAMILIES
from tests.granite_checkpoint import FAMILIES as GRANITE
from tests.harness import pools, prefill

TOL = 1e-4


def prompt(n: int, seed: int = 1, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    model, _ = load_checkpoint(path, "float32", "cpu", show_progress=False)
    ids = prompt(150)
    ours = prefill(model, ids)
    assert (ours - hf_logits(hf, ids)).abs().max().item() < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_one_pass(checkpoints, family):
    path, _ = checkpoints[family]
    model, _ = load_checkpoint(path, "float32", "cpu", show_progress=False)
    ids = prompt(150, seed=2)
    whole = prefill(model, ids)
    for cuts in ([1], [15, 16, 17, 64, 65], [3, 4, 5, 100, 149], list(range(7, 150, 29))):  # 16: SSD chunks
        assert (prefill(model, ids, cuts) - whole).abs().max().item() < TOL, cuts


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_long_segments_split_into_pieces_match_transformers(checkpoints, family, monkeypatch):
    """Segments longer than the linear layers' largest piece are run piece by piece, state carried over."""
    monkeypatch.setattr(recurrent, "MAX_PIECE", 37)
    path, hf = checkpoints[family]
    model, _ = load_checkpoint(path, "float32", "cpu", show_progress=False)
    ids = prompt(150, seed=3)
    assert (prefill(model, ids) - hf_logits(hf, ids)).abs().max().item() < TOL
    assert (prefill(model, ids, [40, 74, 111]) - hf_logits(hf, ids)).abs().max().item() < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    ids = prompt(40, seed=3)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = expected[0, len(ids):].tolist()
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.02)
    out = llm.generate(ids, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == expected


def test_generation_stops_where_transformers_does_on_a_generation_config_eos(checkpoints, tmp_path):
    """generation_config.json's eos_token_id (here a token the model emits at step 5, besides config.json's) is
    what transformers' generate stops on: so does cairn, with finish_reason stop."""
    path, hf = checkpoints["nemotron_h"]
    shutil.copytree(path, tmp_path / "m")
    ids = prompt(30, seed=5)
    with torch.no_grad():
        free = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    eos = [free[5], hf.config.eos_token_id]
    generation = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                               pad_token_id=0)[0, len(ids):].tolist()
    llm = LLM(model=str(tmp_path / "m"), dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.02)
    out = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.token_ids == expected == free[:6] and out.finish_reason == "stop"


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "nemotron_h", "falcon_h1", *GRANITE])  # 10-70 s each
def test_request_decoded_in_batch_equals_decoded_alone(checkpoints, family):
    path, _ = checkpoints[family]
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.02,
              max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = [prompt(n, seed=10 + n) for n in (5, 33, 70, 12)]
    together = llm.generate(prompts, params)
    for p, batched in zip(prompts, together, strict=True):
        alone = llm.generate(p, params)[0]
        assert batched.token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(batched.logprobs, alone.logprobs, strict=True)) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_state_copied_at_p_resumes_in_another_slot_exactly(checkpoints, family):
    """Copy the working slot at p; let the original run on; restore the copy into a fresh slot with the KV
    pages of [0, p) and continue: the logits equal those of never stopping at p (bitwise, same chunks)."""
    path, _ = checkpoints[family]
    model, _ = load_checkpoint(path, "float32", "cpu", show_progress=False)
    ids = prompt(90, seed=4)
    p = 37
    kv, states = pools(model, num_pages=128, page_size=4)
    never_stopped = prefill(model, ids, cuts=[p], kv=kv, states=states)

    snapshots = states.like(states, 2, "cpu")
    slot_a, table_a = states.alloc(), kv.allocator.alloc(-(-len(ids) // 4))
    prefill(model, ids[:p], kv=kv, states=states, slot=slot_a, page_table=table_a)
    states.copy_to(slot_a, snapshots, 0)
    prefill(model, ids + prompt(20, seed=5), kv=kv, states=states, slot=slot_a,
            page_table=table_a + kv.allocator.alloc(5), start=p)  # the original slot runs on

    slot_b = states.alloc()
    snapshots.copy_to(0, states, slot_b)
    shared, partial = table_a[: p // 4], table_a[p // 4]
    cow = kv.allocator.alloc(1)[0]
    kv.copy_page(partial, cow)  # positions [36, 37) of the partly filled page
    table_b = shared + [cow] + kv.allocator.alloc(-(-len(ids) // 4) - len(shared) - 1)
    resumed = prefill(model, ids, kv=kv, states=states, slot=slot_b, page_table=table_b, start=p)
    assert torch.equal(resumed, never_stopped[p:])
