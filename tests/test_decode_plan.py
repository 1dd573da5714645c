"""The decode plan (cairn/model/decode_plan.py): a pure bf16 decode step on CPU through pre-bound calls of the
fused ops, which must give the module path's bits, batched and alone, on every weight layout; and where it
applies: pure decode batches within the gemv kernel's rows, on the Kernels it was built for, bf16 on CPU."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from cairn import ops
from cairn.bench.checkpoint import write_tokenizer
from cairn.engine.llm import LLM
from cairn.model import decode_plan
from cairn.model.decode_plan import DecodePlan
from tests.checkpoints import hf_model
from tests.cpu_paths import COMPILED
from tests.harness import greedy

PROMPTS = [[3, 17, 91, 4, 250, 8, 8, 61, 12], [200, 1, 77, 5, 13], [9, 9, 140, 33, 71, 2, 18, 44, 101, 7, 66]]


@pytest.fixture(scope="module")
def distinct_norms(tmp_path_factory):
    """{family: checkpoint path} of the planned families with every norm scale random (transformers leaves
    them constant: a plan that applied one layer's norm in another's place would pass on those)."""
    made = {}
    for family in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
        model, path = hf_model(family, seed=1).eval(), tmp_path_factory.mktemp(family)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(-0.5, 0.5)
        model.save_pretrained(str(path))
        write_tokenizer(path)
        made[family] = path
    return made


def bf16_llm(path, **overrides) -> LLM:
    return LLM(model=str(path), dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01, **overrides)


def counting_takes(monkeypatch) -> list[bool]:
    """Every DecodePlan.takes answer from here on, in order."""
    answers, takes = [], DecodePlan.takes

    def counted(self, *args):
        answers.append(takes(self, *args))
        return answers[-1]
    monkeypatch.setattr(DecodePlan, "takes", counted)
    return answers


@pytest.mark.parametrize("path", COMPILED)
@pytest.mark.parametrize("family, layout", [(family, layout) for family in ("qwen3_5", "qwen3_next", "qwen3_5_moe")
                                            for layout in ("gemv", "plain", "int8")
                                            if layout != "int8" or family == "qwen3_5"])  # int8: dense models
def test_decode_through_the_plan_gives_the_module_path_bits(distinct_norms, monkeypatch, family, layout, path):
    """On every compiled path and layout the planned decode gives the module path's bits, batched and alone; and on
    the gemv and int8 layouts a sequence decoded in the batch gets the bits it gets alone (their kernels' rows do not
    depend on the others: not F.linear's, whose oneDNN sums a one-row product in another order)."""
    checkpoint = distinct_norms[family]
    options = {"quantization": "int8"} if layout == "int8" else {"weight_layout": layout}
    planned, modules = bf16_llm(checkpoint, cpu_isa=path, **options), bf16_llm(checkpoint, cpu_isa=path, **options)
    modules.engine.model.plan_decode = False
    taken = counting_takes(monkeypatch)
    batched = greedy(planned, PROMPTS)
    assert any(taken) and not all(taken)  # the decode steps took it, the prefills did not
    alone = [greedy(planned, [p])[0] for p in PROMPTS]
    module_alone = [greedy(modules, [p])[0] for p in PROMPTS]
    for got, ref in zip([*batched, *alone], [*greedy(modules, PROMPTS), *module_alone], strict=True):
        assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs
    if layout != "plain":
        for got, one in zip(batched, alone, strict=True):
            assert got.token_ids == one.token_ids and got.logprobs == one.logprobs


def test_a_family_whose_layers_have_one_part_each_has_no_plan(checkpoints):
    """Nemotron-H: each layer is a mixer or an FFN, which the plan calls whole: nothing to bind."""
    llm = bf16_llm(checkpoints["nemotron_h"][0])
    greedy(llm, PROMPTS[:1])
    assert llm.engine.model.decode_plan() is None


def test_a_float32_model_has_no_plan(checkpoints):
    llm = LLM(model=str(checkpoints["qwen3_5"][0]), dtype="float32", device="cpu", kv_cache_gib=0.01,
              state_cache_gib=0.01)
    assert llm.engine.model.decode_plan() is None


def test_the_plan_follows_the_model_kernels(checkpoints):
    """Kernels whose norm is not the fused op (a wrapper, the reference) bind no layer; the fused ones again do."""
    if not COMPILED:
        pytest.skip("this CPU runs no compiled path")
    model = bf16_llm(checkpoints["qwen3_5"][0], weight_layout="gemv").engine.model
    fused, plan = model.kernels, model.decode_plan()
    assert plan is not None and model.decode_plan() is plan  # built once for these Kernels
    model.kernels = dataclasses.replace(fused, add_rms_norm=lambda *args: ops.fused_add_rms_norm(*args))
    assert model.decode_plan() is None
    model.kernels = fused
    assert model.decode_plan() is not None


def test_the_plan_takes_only_pure_decode_batches_within_its_rows():
    plan = DecodePlan([], max_rows=16)
    assert plan.takes(1, 1) and plan.takes(16, 16)
    assert not plan.takes(17, 17)  # above the gemv kernel's direct rows
    assert not plan.takes(5, 2)  # a prefill piece beside the decode rows


def test_gemv_layout_binds_every_layer_and_says_so_in_one_line(checkpoints, caplog):
    """On the gemv layout every layer of the Qwen3.5 model is planned, its linears reaching the kernel directly
    (the plan's rows limit is the kernel's, not infinite), and the build says so in one log line."""
    model = bf16_llm(checkpoints["qwen3_5"][0], weight_layout="gemv").engine.model
    if model.layers[0].mlp.gate_up.__class__.__name__ != "GemvLinear":
        pytest.skip("the gemv kernel does not build here")
    with caplog.at_level(logging.INFO, logger="cairn.model.decode_plan"):
        plan = decode_plan.build(model)
    rows, layers = model.layers[0].mlp.gate_up.direct_rows, len(model.layers)
    assert plan.max_rows == rows
    assert all(call is not layer for call, layer in zip(plan.layers, model.layers, strict=True))
    assert [r.getMessage() for r in caplog.records] == [f"decode plan: {layers} of {layers} layers through pre-bound "
                                                        f"calls, for pure decode batches of up to {rows} rows"]
