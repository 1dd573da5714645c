"""The decode path: the recurrent step, the weight layouts and int8 weight-only quantization.

The recurrent step is checked against the gated delta rule written out token by token; the layouts
and quantization against the float model on the tiny test checkpoints (logits through prefill, and
single-token steps, which take the small-batch kernels).
"""

from __future__ import annotations

import logging

import pytest
import torch

from cairn.engine.llm import LLM
from cairn.model import layout
from cairn.model.layout import Int8Linear, PackedLinear, QuantizationError, decode_weight_bytes, quantize
from cairn.model.loader import load_checkpoint
from cairn.ops import cpu_attention, cpu_gdn, cpu_gemv, cpu_norm, cpu_silu
from cairn.ops.gdn import l2norm, recurrent_gated_delta_rule
from cairn.request.sampling_params import SamplingParams
from tests.cpu_paths import BEST, FLAGS, ICELAKE, OLD_X86, ZEN3, ZEN4
from tests.harness import prefill

# The tiny random checkpoints are sensitive to weight rounding: bf16 weights alone move their logits by
# 4% of the logits' spread (root mean square over positions and vocabulary). int8 weights, one scale per
# output channel, measured 7% here: held to 15%, and to at most 3x what bf16 rounding does.
INT8_RMS_TOL = 0.15
INT8_VS_BF16 = 3.0
BF16_AVAILABLE = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_step(q, k, v, g, beta, state):
    """S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q, one sequence and head at a time."""
    state = state.clone()
    batch, heads, dk, _ = state.shape
    out = torch.empty(batch, heads, v.shape[-1])
    groups = heads // q.shape[1]
    for b in range(batch):
        for h in range(heads):
            qh = l2norm(q[b, h // groups].double()) * dk ** -0.5
            kh = l2norm(k[b, h // groups].double())
            s = state[b, h].double() * g[b, h].double().exp()
            s = s + torch.outer(kh, beta[b, h].double() * (v[b, h].double() - s.T @ kh))
            out[b, h] = (s.T @ qh).float()
            state[b, h] = s.float()
    return out, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_step_matches_the_rule_token_by_token(dtype):
    """fp32 state whatever the activations' dtype; the state is updated in place."""
    gen = torch.Generator().manual_seed(0)
    batch, k_heads, heads, dk, dv = 3, 2, 4, 16, 8
    q, k = (torch.randn(batch, k_heads, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(batch, heads, dv, generator=gen).to(dtype)
    g = -torch.rand(batch, heads, generator=gen)
    beta = torch.rand(batch, heads, generator=gen).to(dtype)
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    expected_out, expected_state = reference_step(q, k, v, g, beta, state)
    out, new_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert new_state is state and state.dtype == torch.float32 and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (state - expected_state).abs().max().item() < 1e-5
    assert (out.float() - expected_out).abs().max().item() < tol


def test_int8_weights_round_to_the_nearest_step_of_their_channel():
    w = torch.randn(48, 32) * torch.linspace(0.01, 1.0, 48)[:, None]
    lin = Int8Linear(w)
    step = lin.scales[:, None]
    assert ((lin.weight.float() * step - w).abs() <= step / 2 + 1e-7).all()
    assert lin.weight.abs().max().item() <= 127
    x = torch.randn(9, 32)
    for rows in (1, Int8Linear.DIRECT_ROWS, 9):  # the fused int8 kernel and the convert-and-multiply path
        assert torch.allclose(lin(x[:rows]), x[:rows] @ (lin.weight.float() * step).T, atol=1e-5)


def rms_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).pow(2).mean().sqrt() / ref.std()).item()


def test_int8_logits_stay_close_to_the_float_model(checkpoints):
    path, _ = checkpoints["qwen3_5_text"]
    float_model, cfg = load_checkpoint(path, "float32", "cpu", show_progress=False)
    bf16_model, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    int8_model, _ = load_checkpoint(path, "float32", "cpu", show_progress=False)
    quantize(int8_model, cfg, "int8", torch.device("cpu"))
    prompt = ids(60)
    cuts = list(range(50, 60))  # the last ten tokens one at a time: the small-batch int8 kernel
    ref = prefill(float_model, prompt, cuts)
    int8_error = rms_error(prefill(int8_model, prompt, cuts), ref)
    bf16_error = rms_error(prefill(bf16_model, prompt, cuts), ref)
    assert 0 < int8_error < INT8_RMS_TOL
    assert int8_error < INT8_VS_BF16 * bf16_error
    assert decode_weight_bytes(int8_model) < 0.6 * decode_weight_bytes(float_model)


def test_int8_engine_generates_and_reports_its_layout(checkpoints):
    path, _ = checkpoints["qwen3_5"]
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01,
              quantization="int8")
    assert llm.engine.weight_layout == "int8"
    out = llm.generate([ids(20), ids(7, seed=2)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [8, 8]


def test_int8_is_refused_in_one_line_on_moe_models(checkpoints):
    path, _ = checkpoints["qwen3_5_moe"]
    with pytest.raises(QuantizationError, match="not implemented for MoE models") as info:
        LLM(model=str(path), dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01,
            quantization="int8")
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not BF16_AVAILABLE, reason="oneDNN without bf16 on this CPU")
def test_packed_bf16_layout_gives_the_plain_logits(checkpoints):
    path, _ = checkpoints["qwen3_next"]
    plain, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    packed, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    assert layout.apply_layout(packed, "packed", torch.bfloat16, torch.device("cpu")) == "packed"
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert decode_weight_bytes(packed) == decode_weight_bytes(plain)
    prompt = ids(40, seed=3)
    ref, got = prefill(plain, prompt, [30, 35, 36]), prefill(packed, prompt, [30, 35, 36])
    # the same bf16 products, summed in another order: differences at bf16 rounding, not more
    assert (got - ref).abs().max().item() < 0.02 * ref.std().item()


def test_auto_layout_is_chosen_per_machine_and_logged(caplog, monkeypatch):
    monkeypatch.delenv("CAIRN_CPU_ISA", raising=False)  # the machine's own path, not one a forced-path run asks for
    cpu = torch.device("cpu")
    assert layout.choose_layout("auto", torch.float32, cpu)[0] == "plain"
    # bf16: cairn's gemv kernel where the CPU has AVX512-BF16 and it builds, plain elsewhere
    assert layout.choose_layout("auto", torch.bfloat16, cpu, cpu_flags=ZEN4)[0] in ("gemv", "plain")
    # AVX2 + FMA only: gemv where F.linear's bf16 has no oneDNN (ATen's fallback GEMM), plain where it has
    assert layout.choose_layout("auto", torch.bfloat16, cpu, cpu_flags=ICELAKE, onednn_bf16=True)[0] == "plain"
    assert layout.choose_layout("auto", torch.bfloat16, cpu, cpu_flags=ZEN3, onednn_bf16=False)[0] in (
        "gemv", "plain")
    # ... and where that path is asked for (--cpu-isa avx2), as on such a CPU, whatever oneDNN has
    assert layout.choose_layout("auto", torch.bfloat16, cpu, cpu_flags=ICELAKE, onednn_bf16=True, cpu_path="avx2",
                                path_forced=True)[0] in ("gemv", "plain")
    assert layout.choose_layout("auto", torch.bfloat16, cpu, cpu_flags=OLD_X86)[0] == "plain"
    assert layout.choose_layout("auto", torch.bfloat16, cpu, cpu_flags=ZEN4, cpu_path="none")[0] == "plain"
    assert layout.choose_layout("auto", torch.bfloat16, torch.device("cuda"))[0] == "plain"
    with pytest.raises(ValueError, match="packed needs"):
        layout.choose_layout("packed", torch.float32, cpu)
    with caplog.at_level(logging.INFO, logger="cairn.model.layout"):
        LLM(dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01)
    assert any("weight layout: plain" in r.getMessage() for r in caplog.records)
    if BEST in ("avx512_bf16", "amx_bf16") or (BEST == "avx2" and not layout.onednn_has_bf16()):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cairn.model.layout"):
            llm = LLM(dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01)
        assert llm.engine.weight_layout == "gemv"
        isa = cpu_gemv.load(FLAGS).isa  # amx_bf16 where the CPU and the OS grant AMX
        said = "gemv at every row count" if isa == "avx2" else "gemv up to"  # the AVX2 path takes any rows
        assert any("weight layout: gemv" in r.getMessage() and f"{isa} {said}" in r.getMessage()
                   for r in caplog.records)


def _scattered(pool: torch.Tensor, pages: list[int], at: list[int]) -> torch.Tensor:
    """A copy of `pool` whose pages `at` hold what `pages` hold in `pool` (the rest is noise)."""
    out = torch.randn_like(pool)
    out[at] = pool[pages]
    return out


@pytest.mark.parametrize("context_len", [1, 9, 12])
def test_attention_reads_consecutive_pages_in_place_with_the_gathered_result(context_len):
    """A sequence whose pages are consecutive reads them as a view of the pool, and gets bit for bit
    what the same keys and values give when gathered from scattered pages."""
    from cairn.ops.attention import gather_pages, paged_decode_attention, paged_prefill_attention

    gen = torch.Generator().manual_seed(context_len)
    k_pool, v_pool = (torch.randn(8, 4, 2, 16, generator=gen) for _ in range(2))  # pages of 4 tokens
    pages, scattered = [2, 3, 4], [6, 0, 5]
    num_pages = -(-context_len // 4)
    k_far, v_far = _scattered(k_pool, pages, scattered), _scattered(v_pool, pages, scattered)
    near, far = torch.tensor(pages[:num_pages]), torch.tensor(scattered[:num_pages])

    keys = gather_pages(k_pool, near, context_len)
    assert keys.untyped_storage().data_ptr() == k_pool.untyped_storage().data_ptr()  # a view, no copy
    assert torch.equal(keys, gather_pages(k_far, far, context_len))

    q = torch.randn(1, 4, 16, generator=gen)
    lens = torch.tensor([context_len])
    assert torch.equal(paged_decode_attention(q, k_pool, v_pool, near[None], lens, 0.25),
                       paged_decode_attention(q, k_far, v_far, far[None], lens, 0.25))
    q_new = torch.randn(min(context_len, 5), 4, 16, generator=gen)
    assert torch.equal(paged_prefill_attention(q_new, k_pool, v_pool, near, context_len, 0.25),
                       paged_prefill_attention(q_new, k_far, v_far, far, context_len, 0.25))


def test_a_bf16_cpu_engine_loads_its_fused_ops_at_start_not_on_the_first_request():
    """The fused ops build (minutes, once) or load from torch's cache when the engine starts, before the server
    answers /health: not inside the first request's decode step. A float32 engine loads none."""
    loaders = [cpu_gdn._loaded, cpu_norm._loaded, cpu_silu._loaded, cpu_attention._loaded]
    for loaded in loaders:
        loaded.cache_clear()
    LLM(dtype="float32", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01)
    assert [loaded.cache_info().currsize for loaded in loaders] == [0, 0, 0, 0]
    llm = LLM(dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01)
    loaded_ops = int(llm.engine.cpu_path != "none")  # a machine (or a run) on the path none builds and loads none
    assert [loaded.cache_info().currsize for loaded in loaders] == [loaded_ops] * 4
