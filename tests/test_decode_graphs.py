"""The decode graph path (cairn/decode_graphs.py) against the eager path, through the checking stand-in.

No GPU here: the engine runs the graph path with cairn.ops.graph_check.CheckingGraphBackend, a stand-in
for CUDA graph capture that runs each replay again and fails unless the step is what a CUDA graph would
freeze (same ops, arguments and buffer addresses; no host sync or host read). Every pure decode step is
computed twice from the same pools: eagerly (the graph path switched off), then through the graph path,
and the two are compared (`Lockstep`). Two waves of requests, the second reusing the slots and pages the
first freed, cover every bucket with padding rows (5 sequences in bucket 8, 3 in bucket 4).

What "equal" means (docs/gpu.md): the same greedy tokens, logits within float32 rounding. They are bit
for bit equal when the eager step reads as many key positions (its page tables padded to the graph's
width) and has as many rows as the bucket; otherwise they differ at the last bits: SDPA's softmax sums over
every key it is given, masked or not, and the graph always gives max_model_len / page_size pages; and the
BLAS may pick another kernel for a product with more (padding) rows.
"""

from __future__ import annotations

import pytest
import torch

from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.ops.graph_check import CheckingGraphBackend
from cairn.request.sampling_params import SamplingParams
from tests.checkpoints import NEMOTRON_H, _randomise_nemotron_h, write_checkpoint

FAMILIES = ("qwen3_5_text", "nemotron_h_dense")
LOGITS_TOL = 1e-5  # float32: observed differences are below 2e-6 (see the module docstring)
BF16_LOGITS_TOL = 0.05  # bfloat16: observed differences up to 0.016 (logits of magnitude ~1-5)
WAVES = ((1, [2, 3, 4, 5, 7]), (2, [2, 3, 5]))  # (prompt seed, max_tokens per request): 5 then 3 requests


def write_dense_nemotron_h(path) -> None:
    """Nemotron-H without MoE layers (as Nemotron-H 8B / 47B): Mamba2, attention and MLP. The test family
    `nemotron_h` has MoE layers, which the graph path refuses (their routing reads counts on the host)."""
    import transformers as tf

    from cairn.bench.checkpoint import write_tokenizer

    torch.manual_seed(0)
    model = tf.NemotronHForCausalLM(tf.NemotronHConfig(**{**NEMOTRON_H, "hybrid_override_pattern": "M-M*-M*-"}))
    _randomise_nemotron_h(model)
    model.save_pretrained(str(path))
    write_tokenizer(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    made = {"qwen3_5_text": tmp_path_factory.mktemp("qwen3_5_text"),
            "nemotron_h_dense": tmp_path_factory.mktemp("nemotron_h_dense")}
    write_checkpoint("qwen3_5_text", made["qwen3_5_text"])
    write_dense_nemotron_h(made["nemotron_h_dense"])
    return made


def engine(path, backend=None, dtype="float32") -> Engine:
    cfg = config_with_overrides(EngineConfig(), model=str(path), dtype=dtype, device="cpu", kv_cache_gib=0.002,
                                state_cache_gib=0.01, max_num_seqs=8, page_size=4, max_model_len=96,
                                prefix_cache=False)
    return Engine(cfg, show_progress=False, graph_backend=backend)


def pools(eng: Engine) -> dict[str, torch.Tensor]:
    """Copies of the whole KV pool and of every state slot."""
    copies = {"k": eng.kv.k.clone(), "v": eng.kv.v.clone()}
    for slot in range(eng.states.num_slots):
        copies.update({f"{slot}.{n}": t.clone() for n, t in eng.states.read_slot(slot).items()})
    return copies


def restore(eng: Engine, saved: dict[str, torch.Tensor]) -> None:
    eng.kv.k.copy_(saved["k"])
    eng.kv.v.copy_(saved["v"])
    for slot in range(eng.states.num_slots):
        for n, t in eng.states.read_slot(slot).items():
            t.copy_(saved[f"{slot}.{n}"])


class Lockstep:
    """Wraps engine.runner.run: each graph step is run eagerly first from the same pools, then restored and
    run through the graph path; both results are kept per step for the test to compare."""

    def __init__(self, eng: Engine, pad_eager_tables: bool = False):
        self.eng, self.runner, self.steps = eng, eng.runner, []
        self.taken: list[tuple[int, int, bool]] = []  # per step: (num_decode, num_seqs, took the graph path)
        self.run = self.runner.run
        self.runner.run = self._run
        if pad_eager_tables:  # the eager step reads as many key positions as the graph's
            build, width = self.runner._build, self.runner.graphs.width

            def padded(items, num_decode, pool):
                fb, sampled = build(items, num_decode, pool)
                fb.page_tables = torch.nn.functional.pad(fb.page_tables, (0, width - fb.page_tables.shape[1]))
                return fb, sampled

            self.runner._build = padded

    def _run(self, batch):
        self.taken.append((batch.num_decode, len(batch.seqs), self.runner.takes_graph(batch)))
        if not self.taken[-1][2]:
            return self.run(batch)
        graphs, before = self.runner.graphs, pools(self.eng)
        self.runner.graphs = None
        eager_logits, eager_seqs = self.run(batch)
        eager_pools = pools(self.eng)
        self.runner.graphs = graphs
        restore(self.eng, before)
        logits, seqs = self.run(batch)
        order = [seqs.index(s) for s in eager_seqs]
        self.steps.append({"seqs": [(s.state_slot, list(s.page_table), s.num_tokens - 1) for s in seqs],
                           "bucket": graphs.bucket(len(seqs)), "eager": eager_logits, "graph": logits[order],
                           "before": before, "eager_pools": eager_pools, "after": pools(self.eng)})
        return logits, seqs


def drive(eng: Engine) -> dict[str, list[int]]:
    """Two waves of greedy requests of different lengths, the second after the first finished."""
    tokens: dict[str, list[int]] = {}
    for seed, lengths in WAVES:
        gen = torch.Generator().manual_seed(seed)
        for i, n in enumerate(lengths):
            prompt = torch.randint(3, 300, (7 + 3 * i,), generator=gen).tolist()
            tokens[eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))] = []
        while eng.has_unfinished():
            for out in eng.step():
                tokens[out.request_id].extend(out.delta_token_ids)
    return tokens


def live_regions(eng: Engine, step: dict) -> tuple[set[int], torch.Tensor]:
    """The step's live state slots, and a mask [num_pages, page_size] of the KV entries its rows wrote."""
    written = torch.zeros(eng.kv.num_pages, eng.kv.page_size, dtype=torch.bool)
    for _, table, p in step["seqs"]:
        written[table[p // eng.kv.page_size], p % eng.kv.page_size] = True
    return {slot for slot, _, _ in step["seqs"]}, written


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN patterns included (slots never written hold uninitialised memory)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module", params=FAMILIES)
def graphed(request, paths):
    """(family, engine, lockstep, tokens) of one graph-path run of both waves, each step also run eagerly."""
    backend = CheckingGraphBackend()
    eng = engine(paths[request.param], backend)
    lock = Lockstep(eng)
    return request.param, eng, lock, drive(eng)


def test_graph_decode_gives_the_eager_tokens_in_every_bucket_after_slots_and_pages_are_reused(paths, graphed):
    family, eng, lock, tokens = graphed
    assert tokens == drive(engine(paths[family]))  # the same greedy tokens as an engine without the flag
    shapes = {(len(s["seqs"]), s["bucket"]) for s in lock.steps}
    assert {(5, 8), (3, 4), (2, 2), (1, 1)} <= shapes  # every bucket, with padding rows in two of them
    backend = eng.runner.graphs.backend
    assert backend.captures == len(eng.runner.graphs.buckets) == 4
    assert backend.replays == len(lock.steps)
    first_wave = {slot for s in lock.steps[:3] for slot, _, _ in s["seqs"]}
    assert first_wave & {slot for slot, _, _ in lock.steps[-1]["seqs"]}  # the second wave reuses slots
    first_pages = {p for s in lock.steps[:3] for _, table, _ in s["seqs"] for p in table}
    assert first_pages & {p for _, table, _ in lock.steps[-1]["seqs"] for p in table}  # ... and pages
    for step in lock.steps:
        assert torch.equal(step["graph"].argmax(-1), step["eager"].argmax(-1))
        torch.testing.assert_close(step["graph"], step["eager"], rtol=0, atol=LOGITS_TOL)
    eng.check_integrity()


def test_padding_rows_touch_only_the_scratch_page_and_slot(graphed):
    _, eng, lock, _ = graphed
    graphs = eng.runner.graphs
    assert lock.steps
    for step in lock.steps:
        slots, written = live_regions(eng, step)
        assert graphs.scratch_slot not in slots
        assert all(graphs.scratch_page not in table for _, table, _ in step["seqs"])
        before, after, eager = step["before"], step["after"], step["eager_pools"]
        untouched = ~written
        untouched[graphs.scratch_page] = False
        for name in before:
            if name in ("k", "v"):
                assert same_bytes(after[name][:, untouched], before[name][:, untouched])
                torch.testing.assert_close(after[name][:, written], eager[name][:, written], rtol=0,
                                           atol=LOGITS_TOL)
            elif int(name.split(".")[0]) in slots:
                torch.testing.assert_close(after[name], eager[name], rtol=0, atol=LOGITS_TOL)
            elif int(name.split(".")[0]) != graphs.scratch_slot:
                assert same_bytes(after[name], before[name]), name  # another slot: bytewise untouched


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_decode_is_bit_equal_to_eager_at_the_same_shapes(paths, family):
    """The same key positions (the eager tables padded to the graph's width) and as many rows as the
    bucket: the graph path computes the eager path's bits, logits and states."""
    eng = engine(paths[family], CheckingGraphBackend())
    lock = Lockstep(eng, pad_eager_tables=True)
    drive(eng)
    full = [s for s in lock.steps if len(s["seqs"]) == s["bucket"]]
    assert {s["bucket"] for s in full} >= {1, 2, 4}
    for step in full:
        assert torch.equal(step["graph"], step["eager"])
        slots, written = live_regions(eng, step)
        assert torch.equal(step["after"]["k"][:, written], step["eager_pools"]["k"][:, written])
        for name, t in step["after"].items():
            if name[0].isdigit() and int(name.split(".")[0]) in slots:
                assert same_bytes(t, step["eager_pools"][name]), name


def test_bf16_graph_decode_gives_the_eager_tokens(paths):
    """bfloat16 (the fused CPU decode ops included): the same greedy tokens; logits within bf16 rounding of the
    attention output, which differs for the reason float32's last bits do (module docstring)."""
    eng = engine(paths["qwen3_5_text"], CheckingGraphBackend(), dtype="bfloat16")
    lock = Lockstep(eng)
    drive(eng)
    assert len(lock.steps) > 5
    for step in lock.steps:
        assert torch.equal(step["graph"].argmax(-1), step["eager"].argmax(-1))
        torch.testing.assert_close(step["graph"], step["eager"], rtol=0, atol=BF16_LOGITS_TOL)


def test_mixed_and_prefill_steps_stay_eager(graphed):
    _, _, lock, _ = graphed
    assert all(graph == (num_decode == num_seqs) for num_decode, num_seqs, graph in lock.taken)
    assert any(graph for *_, graph in lock.taken) and not all(graph for *_, graph in lock.taken)
