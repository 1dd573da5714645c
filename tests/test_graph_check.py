"""The checking stand-in for CUDA graphs (cairn/ops/graph_check.py), the scratch reservations and the flag's refusals.

The stand-in is what lets a CPU test say a decode step is graph-safe, so it is tested for failing: on toy
steps (each kind of host sync or host read, a tensor from outside the step, a shape or a buffer that
changes between replays) and on the engine's decode step with a seeded fault (consecutive_run left on,
context lengths built from the host list, a host int of the capture step baked into the batch).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from cairn.cli import main as cli_main
from cairn.config import ConfigError, EngineConfig, config_with_overrides
from cairn.decode_graphs import DecodeGraphs, buckets
from cairn.engine.engine import Engine, StepFailed
from cairn.forward_batch import ForwardBatch
from cairn.memory.pages import PageAllocator
from cairn.ops import REFERENCE, attention, cuda_graphs
from cairn.ops.graph_check import CheckingGraphBackend, GraphUnsafe
from cairn.request.sampling_params import SamplingParams
from tests.checkpoints import write_checkpoint
from tests.harness import state_pool


def capture(step, **static):
    return CheckingGraphBackend().capture(step, static)


# ---- the stand-in on toy steps ----------------------------------------------------------------------

def test_a_clean_step_replays_into_the_output_of_its_capture():
    x = torch.zeros(4)
    replay = capture(lambda: torch.arange(4) + x * 2, x=x)
    x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    out = replay()
    assert torch.equal(out, torch.tensor([2.0, 5.0, 8.0, 11.0]))
    x.fill_(0)
    assert replay() is out and torch.equal(out, torch.arange(4).float())


@pytest.mark.parametrize("sync", [lambda x: x.sum().item(), lambda x: int(x[0]), lambda x: x.tolist(),
                                  lambda x: torch.nonzero(x), lambda x: bool((x > 0).any()),
                                  lambda x: torch.equal(x, x), lambda x: x.numpy()],
                         ids=["item", "int", "tolist", "nonzero", "bool", "equal", "numpy"])
def test_a_host_sync_or_host_read_fails_at_capture(sync):
    x = torch.ones(4)
    with pytest.raises(GraphUnsafe):
        capture(lambda: (sync(x), x + 1)[1], x=x)


def test_a_tensor_built_from_host_data_fails():
    lens = [3, 5]
    x = torch.ones(2)
    with pytest.raises(GraphUnsafe, match="neither a static buffer"):
        capture(lambda: x + torch.tensor(lens), x=x)


def test_a_tensor_from_outside_the_step_that_is_not_registered_fails():
    x, kept = torch.ones(2), torch.ones(2)
    with pytest.raises(GraphUnsafe, match="neither a static buffer"):
        capture(lambda: x + kept, x=x)


def test_a_shape_chosen_from_host_values_fails_at_replay():
    x, host = torch.ones(8), {"n": 2}
    replay = capture(lambda: x[: host["n"]] * 2, x=x)
    host["n"] = 5
    with pytest.raises(GraphUnsafe, match="differs from the captured one"):
        replay()


def test_a_scalar_argument_chosen_from_host_values_fails_at_replay():
    x, host = torch.ones(8), {"scale": 2.0}
    replay = capture(lambda: x * host["scale"], x=x)
    host["scale"] = 3.0
    with pytest.raises(GraphUnsafe, match="differs"):
        replay()


def test_a_static_buffer_that_moves_fails_at_replay():
    buffers = {"x": torch.ones(4)}
    static = {"x": buffers["x"], "y": torch.ones(4)}
    replay = CheckingGraphBackend().capture(lambda: buffers["x"] * 2, static)
    buffers["x"] = static["y"]  # the step now reads another buffer: a graph would still read the first
    with pytest.raises(GraphUnsafe, match="differs"):
        replay()


def test_an_op_run_only_from_the_replay_on_fails_naming_both_op_counts():
    x, host = torch.ones(4), {"extra": False}
    replay = capture(lambda: x * 2 + 1 if host["extra"] else x * 2, x=x)
    host["extra"] = True  # a branch on host state: a graph would never run the added op
    with pytest.raises(GraphUnsafe, match="captured 1 ops, replayed 2"):
        replay()


def test_a_tensor_made_on_another_device_fails_at_capture():
    """(On a GPU: a step making a tensor on the CPU, which the graph would wait for; here the other way round.)"""
    x = torch.ones(4)
    with pytest.raises(GraphUnsafe, match="aten::ones touches a tensor on meta, the graph's device is cpu"):
        capture(lambda: (x * 2, torch.ones(4, device="meta").sum())[0], x=x)


def test_an_empty_slice_of_a_static_buffer_replays():
    """An empty tensor has no storage to place: it is recorded by shape alone, whatever its address."""
    x = torch.ones(4)
    replay = capture(lambda: torch.cat([x[:0], x * 2]), x=x)
    x.fill_(3)
    assert torch.equal(replay(), torch.full((4,), 6.0))


# ---- reservations -----------------------------------------------------------------------------------

def test_a_reserved_page_is_never_handed_out_nor_freed():
    pages = PageAllocator(4)
    scratch = pages.reserve()
    assert scratch not in pages.alloc(3) and pages.num_free == 0
    pages.check_integrity()
    with pytest.raises(AssertionError, match="reserved"):
        pages.decref([scratch])
    pages.check_integrity({p: 1 for p in range(4) if p != scratch})


def test_a_reserved_slot_is_never_handed_out_nor_freed():
    states = state_pool(num_slots=3)
    scratch = states.reserve()
    assert scratch not in {states.alloc(), states.alloc()} and states.num_free == 0
    assert states.num_usable == 2
    with pytest.raises(AssertionError):
        states.free(scratch)


def test_buckets_double_up_to_max_num_seqs():
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(12) == [1, 2, 4, 8, 12]


# ---- the engine's decode step ---------------------------------------------------------------------

def demo(backend=None, **overrides) -> Engine:
    cfg = config_with_overrides(EngineConfig(), device="cpu", kv_cache_gib=0.01, state_cache_gib=0.05, max_num_seqs=4,
                                page_size=4, max_model_len=64, prefix_cache=False, **overrides)
    return Engine(cfg, show_progress=False, graph_backend=backend)


def decode_one(eng: Engine) -> None:
    eng.add_request(list(range(10, 21)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()


def test_the_demo_decodes_through_the_stand_in_and_reserves_its_scratch():
    backend = CheckingGraphBackend()
    eng = demo(backend)
    decode_one(eng)
    graphs = eng.runner.graphs
    assert backend.captures == 1 and backend.replays == 3  # bucket 1: captured once, replayed each step
    assert eng.states.num_slots == 5 and eng.states.num_usable == 4 and eng.states.reserved == [graphs.scratch_slot]
    assert eng.kv.allocator.reserved == [graphs.scratch_page]
    assert eng.max_model_len == 64 and graphs.width == 16
    eng.check_integrity()
    assert eng.pool_use()["working_slots_use"] == 0


def test_a_max_model_len_cut_to_the_kv_pool_is_warned_once_with_the_graph_path_on(caplog):
    cfg = config_with_overrides(EngineConfig(), device="cpu", kv_cache_gib=0.01, state_cache_gib=0.05, max_num_seqs=4,
                                page_size=4, max_model_len=100_000, prefix_cache=False)
    with caplog.at_level(logging.WARNING):
        eng = Engine(cfg, show_progress=False, graph_backend=CheckingGraphBackend())
    warnings = [r.getMessage() for r in caplog.records if "--max-model-len" in r.getMessage()]
    assert warnings == [f"--max-model-len 100000 cut to {eng.max_model_len} tokens: the KV pool holds no more "
                        f"({eng.kv.num_pages - 1} pages of 4 tokens); raise --kv-cache-gib for a longer context"]
    assert eng.max_model_len == (eng.kv.num_pages - 1) * 4 == eng.runner.graphs.width * 4  # less the scratch page


def failure_of(eng: Engine) -> BaseException:
    with pytest.raises(StepFailed) as info:
        decode_one(eng)
    return info.value.__cause__


def test_consecutive_run_left_on_fails_the_stand_in():
    eng = demo(CheckingGraphBackend())
    eng.model.kernels = dataclasses.replace(eng.model.kernels, paged_decode_attention=attention.paged_decode_attention)
    cause = failure_of(eng)
    assert isinstance(cause, GraphUnsafe) and "__int__" in str(cause)


def test_context_lengths_from_the_host_list_fail_the_stand_in(monkeypatch):
    def from_host(self):  # the eager path's way: a tensor built from the list, frozen at capture under a graph
        return torch.tensor(self.context_lens[: self.num_decode])

    monkeypatch.setattr(ForwardBatch, "decode_context_lens", from_host)
    cause = failure_of(demo(CheckingGraphBackend()))
    assert isinstance(cause, GraphUnsafe) and "neither a static buffer" in str(cause)


def test_a_host_int_baked_into_the_step_fails_the_stand_in(monkeypatch):
    real = DecodeGraphs._step

    def baked(self, size):  # page tables cut to the step's longest sequence, a host int: frozen at capture
        longest = -(-max(self.host_context_lens[:size]) // self.kv.page_size)
        full, self.page_tables = self.page_tables, self.page_tables[:, :longest]
        try:
            return real(self, size)
        finally:
            self.page_tables = full

    monkeypatch.setattr(DecodeGraphs, "_step", baked)
    cause = failure_of(demo(CheckingGraphBackend()))
    assert isinstance(cause, GraphUnsafe) and "differs from the captured one" in str(cause)


# ---- the flag ---------------------------------------------------------------------------------------

def test_cuda_graphs_are_off_by_default():
    assert EngineConfig().model.cuda_graphs is False
    assert demo().runner.graphs is None


def test_cuda_graphs_are_refused_in_one_line_on_a_cpu(capsys):
    with pytest.raises(ConfigError, match="needs a CUDA device") as info:
        demo(cuda_graphs=True)
    assert "\n" not in str(info.value)
    assert cli_main(["generate", "hi", "--device", "cpu", "--cuda-graphs", "--max-tokens", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cairn generate: error:")]
    assert errors == ["cairn generate: error: --cuda-graphs needs a CUDA device (this one is cpu); drop the flag"]


def test_a_decode_kernel_not_known_to_be_graph_safe_is_refused():
    fast = dataclasses.replace(REFERENCE, name="cuda[flashinfer]", paged_decode_attention=lambda *a: None)
    reason = cuda_graphs.refusal(fast, ("dense",))
    assert "paged_decode_attention" in reason and "\n" not in reason
    prefill_only = dataclasses.replace(REFERENCE, name="cuda[x]", chunk_gated_delta_rule=lambda *a: None)
    assert cuda_graphs.refusal(prefill_only, ("dense",)) is None  # prefill kernels never run under a graph
    assert cuda_graphs.refusal(REFERENCE, ("dense",)) is None
    assert cuda_graphs.device_refusal(torch.device("cuda")) is None and cuda_graphs.device_refusal(torch.device("cpu"))


def test_moe_models_are_refused(tmp_path):
    write_checkpoint("nemotron_h", tmp_path)
    with pytest.raises(ConfigError, match="MoE") as info:
        demo(CheckingGraphBackend(), model=str(tmp_path), dtype="float32")
    assert "\n" not in str(info.value)
