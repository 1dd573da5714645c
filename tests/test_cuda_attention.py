"""The FlashInfer paged-attention adapter (cairn/ops/cuda_attention.py) on CPU, against the reference.

No GPU here: `StandInDecodeWrapper` / `StandInPrefillWrapper` are CPU STAND-INS with the signatures of
FlashInfer's BatchDecodeWithPagedKVCacheWrapper / BatchPrefillWithPagedKVCacheWrapper (constructor
(workspace, "NHD"), plan(...), run(q, (k_cache, v_cache))). They read the pages only through the CSR
description the adapter planned (indptr, indices, last_page_len), so the tests check that description,
the plan's reuse across layers, and the layers' results with the adapter; that FlashInfer itself
matches is for a GPU run (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from cairn.engine.llm import LLM
from cairn.ops import REFERENCE, attention, cuda_attention, select_kernels
from tests.test_cuda_conv import assert_same_generations, greedy


class StandInWrapper:
    plans = 0  # plan() calls, over all instances

    def __init__(self, workspace, kv_layout):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.plan_args = None

    def _attend(self, q, kv_cache, qo_rows: list[tuple[int, int]], causal: bool):
        indptr, indices, last, heads, kv_heads, dim, page_size = self.plan_args
        k_cache, v_cache = kv_cache
        assert k_cache.shape[1:] == (page_size, kv_heads, dim) and q.shape[1:] == (heads, dim)
        out = torch.empty_like(q)
        for b, (lo, hi) in enumerate(qo_rows):
            pages = indices[indptr[b]:indptr[b + 1]].long()
            length = (len(pages) - 1) * page_size + int(last[b])
            k, v = (c[pages].flatten(0, 1)[:length].transpose(0, 1) for c in (k_cache, v_cache))  # [kvh, S, d]
            qh = q[lo:hi].transpose(0, 1)
            mask = None
            if causal:  # query i sits at position length - (hi - lo) + i
                mask = torch.ones(hi - lo, length, dtype=torch.bool).tril(length - (hi - lo))
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[lo:hi] = o.transpose(0, 1)
        return out


class StandInDecodeWrapper(StandInWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             sm_scale=None, q_data_type=None, kv_data_type=None):
        StandInWrapper.plans += 1
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert ((last_page_len >= 1) & (last_page_len <= page_size)).all()
        self.plan_args = (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size)
        self.scale = sm_scale

    def run(self, q, paged_kv_cache):
        return self._attend(q, paged_kv_cache, [(b, b + 1) for b in range(q.shape[0])], causal=False)


class StandInPrefillWrapper(StandInWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None, q_data_type=None,
             kv_data_type=None):
        StandInWrapper.plans += 1
        self.qo = qo_indptr.tolist()
        self.plan_args = (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                          head_dim_qk, page_size)
        self.scale, self.causal = sm_scale, causal

    def run(self, q, paged_kv_cache):
        return self._attend(q, paged_kv_cache, list(zip(self.qo[:-1], self.qo[1:], strict=True)), self.causal)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = StandInDecodeWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = StandInPrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(cuda_attention, "WORKSPACE_BYTES", 1024)
    return module


def pool(pages: int = 12, page_size: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(pages, page_size, 2, 8, generator=gen), torch.randn(pages, page_size, 2, 8, generator=gen))


def test_csr_lists_each_sequences_pages_in_order_and_its_last_page_fill():
    tables = torch.tensor([[7, 2, 9, 0], [3, 0, 0, 0], [1, 4, 5, 6]])
    indptr, indices, last = cuda_attention.paged_kv_csr(tables, torch.tensor([9, 4, 13]), page_size=4)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 2, 9, 3, 1, 4, 5, 6]
    assert last.tolist() == [1, 4, 1]


def test_decode_adapter_matches_the_reference_and_plans_once_per_step(fake_flashinfer):
    k_pool, v_pool = pool()
    q = torch.randn(3, 4, 8)
    tables = torch.tensor([[7, 2, 9, 0], [3, 0, 0, 0], [1, 4, 5, 6]])
    lens = torch.tensor([9, 4, 13])
    fast, before = cuda_attention.FlashInferDecode(fake_flashinfer), StandInWrapper.plans
    ref = attention.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3)
    for _ in range(3):  # three layers of one step: one plan
        assert (fast(q, k_pool, v_pool, tables, lens, 0.3) - ref).abs().max().item() < 1e-5
    assert StandInWrapper.plans == before + 1
    lens2 = torch.tensor([10, 4, 13])  # the next step: a new tensor, a new plan
    ref2 = attention.paged_decode_attention(q, k_pool, v_pool, tables, lens2, 0.3)
    assert (fast(q, k_pool, v_pool, tables, lens2, 0.3) - ref2).abs().max().item() < 1e-5
    assert StandInWrapper.plans == before + 2


@pytest.mark.parametrize("new", [13, 5, 1])  # a cold prefill, a resumed prefix, one token
def test_prefill_adapter_matches_the_reference_causal_mask(fake_flashinfer, new):
    k_pool, v_pool = pool(seed=1)
    table = torch.tensor([5, 0, 11, 2, 0])
    q = torch.randn(new, 4, 8)
    ref = attention.paged_prefill_attention(q, k_pool, v_pool, table, 13, 0.25)
    got = cuda_attention.FlashInferPrefill(fake_flashinfer)(q, k_pool, v_pool, table, 13, 0.25)
    assert (got - ref).abs().max().item() < 1e-5


def test_absent_flashinfer_falls_back_to_the_reference(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with caplog.at_level("INFO", logger="cairn.ops.optional"):
        assert cuda_attention.kernels() == {}
    assert "flashinfer unavailable" in caplog.text
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    assert select_kernels("cuda", fast=True) is REFERENCE


def test_gated_attention_model_with_the_adapter_generates_what_the_reference_generates(fake_flashinfer, tmp_path):
    from tests.checkpoints import write_checkpoint

    write_checkpoint("qwen3_5_text", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01,
              page_size=4)
    prompts = [list(range(3, 30)), list(range(40, 49))]  # several pages each, decoded as one batch
    expected = greedy(llm, prompts)
    llm.engine.model.kernels = dataclasses.replace(REFERENCE, name="stand-in", **cuda_attention.kernels())
    before = StandInWrapper.plans
    assert_same_generations(greedy(llm, prompts), expected)
    assert StandInWrapper.plans > before  # the adapter ran
