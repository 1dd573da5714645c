"""cairn's fused Gated DeltaNet decode op (cairn/ops/cpu_gdn.py) against the reference kernels.

The op is compared with the reference composition (conv update, gating, recurrent step, gated norm)
on random shapes, grouped heads and scattered state slots included; in the engine, greedy bf16 decoding
with it is compared with decoding on the reference kernels, and a sequence decoded alone with the same
sequence decoded in a batch (bit for bit). Its dispatch is checked: fp32 stays on the reference, and a
failed build falls back in one log line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cairn import ops
from cairn.engine.llm import LLM
from cairn.layers.norm import GatedRMSNorm
from cairn.ops import cpu_gdn, cpu_isa, gdn
from cairn.ops.conv import causal_conv1d_update
from cairn.ops.gdn import recurrent_gated_delta_rule
from cairn.request.sampling_params import SamplingParams
from tests.cpu_paths import COMPILED, FLAGS
from tests.harness import bf16_decode_against_reference, failed_build, greedy, one_warning_line

# the op's bodies by the widest each path allows (cpu_isa.body): the paths this CPU runs, and the scalar body
BODIES = sorted({cpu_isa.body(p) for p in COMPILED} | {0}) if COMPILED else []
per_body = pytest.mark.parametrize("body", BODIES)
per_path = pytest.mark.parametrize("path", COMPILED)


def op(body: int = 2):
    """The op on its widest body up to `body` (2 AVX-512, 1 AVX2, 0 scalar)."""
    got = cpu_gdn.load()
    if not callable(got):
        pytest.skip(f"the fused GDN op does not build here: {got}")
    return lambda *args: got(*args, body)


def inputs(batch, k_heads, v_heads, dk, dv, kernel, seed):
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * k_heads * dk + v_heads * dv

    def bf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    return {"mixed": bf(batch, conv_dim), "z": bf(batch, v_heads * dv), "b": bf(batch, v_heads),
            "a": bf(batch, v_heads), "conv": bf(batch, conv_dim, kernel - 1),
            "rec": torch.randn(batch, v_heads, dk, dv, generator=gen) * 0.1, "weight": bf(conv_dim, kernel),
            "A_log": bf(v_heads), "dt_bias": bf(v_heads), "norm": bf(dv), "k_heads": k_heads}


def reference(t, eps=1e-6):
    """GatedDeltaNet.forward's decode rows on the reference kernels, between in_proj and out_proj."""
    batch, v_heads, dk, dv = t["rec"].shape
    k_heads = t["k_heads"]
    mixed, conv = causal_conv1d_update(t["mixed"], t["conv"], t["weight"])
    q, k, v = mixed.split([k_heads * dk, k_heads * dk, v_heads * dv], dim=-1)
    g = -t["A_log"].float().exp() * F.softplus(t["a"].float() + t["dt_bias"])
    o, rec = recurrent_gated_delta_rule(q.reshape(batch, k_heads, dk), k.reshape(batch, k_heads, dk),
                                        v.reshape(batch, v_heads, dv), g, t["b"].sigmoid(), t["rec"].clone())
    norm = GatedRMSNorm(dv, eps).bfloat16()
    norm.weight.data = t["norm"]
    return norm(o, t["z"].reshape(batch, v_heads, dv)).reshape(batch, -1), conv, rec


def fused(t, conv, rec, eps=1e-6, body=2):
    return op(body)(t["mixed"], t["z"], t["b"], t["a"], conv, rec, t["weight"], t["A_log"], t["dt_bias"], t["norm"],
                    t["k_heads"], eps)


@per_body
@pytest.mark.parametrize("batch, k_heads, v_heads, dk, dv, kernel", [
    (1, 2, 4, 16, 32, 4), (3, 1, 1, 8, 8, 4), (2, 2, 2, 24, 40, 2), (4, 2, 6, 32, 16, 3)])
def test_fused_decode_matches_the_reference_kernels_within_bf16_rounding(batch, k_heads, v_heads, dk, dv, kernel,
                                                                         body):
    t = inputs(batch, k_heads, v_heads, dk, dv, kernel, seed=batch * 100 + dv)
    ref, ref_conv, ref_rec = reference(t)
    conv, rec = t["conv"].clone(), t["rec"].clone()
    got = fused(t, conv, rec, body=body)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert torch.equal(conv, ref_conv)  # the conv state is a shift: exact
    assert torch.allclose(rec, ref_rec, rtol=1e-5, atol=1e-6)  # fp32 state, sums in another order
    # one bf16 step of the output's magnitude (each rounds its intermediate values to bf16 alike)
    assert ((got.float() - ref.float()).abs() <= 2.0 ** -7 * ref.float().abs() + 1e-2).all()


@per_body
def test_fused_decode_updates_scattered_slots_of_a_pool_view(body):
    """Rows of the pool taken with a stride (a slice of every other slot): the op writes where they lie."""
    t = inputs(2, 2, 4, 16, 16, 4, seed=7)
    pool_conv = torch.zeros(4, *t["conv"].shape[1:], dtype=torch.bfloat16)
    pool_rec = torch.zeros(4, *t["rec"].shape[1:])
    pool_conv[::2], pool_rec[::2] = t["conv"], t["rec"]
    ref, ref_conv, ref_rec = reference(t)
    got = fused(t, pool_conv[::2], pool_rec[::2], body=body)
    assert torch.equal(got, fused(t, t["conv"].clone(), t["rec"].clone(), body=body))
    assert torch.equal(pool_conv[::2], ref_conv) and torch.allclose(pool_rec[::2], ref_rec, rtol=1e-5, atol=1e-6)
    assert not pool_conv[1::2].any() and not pool_rec[1::2].any()


@per_body
@pytest.mark.parametrize("batch, k_heads, v_heads, dk, dv",
                         [(1, 16, 16, 128, 128), (3, 2, 4, 16, 32), (2, 1, 3, 12, 20)])
def test_four_tap_conv_gives_the_same_bits_in_its_vector_form_as_lane_by_lane(batch, k_heads, v_heads, dk, dv, body):
    """A 4-tap conv whose state rows are contiguous takes 8 channels at a time in vector registers (AVX2); a state
    view with another channel stride takes the scalar form. Both give the same outputs and states, bit for bit,
    special values included (channel counts that leave a partial block of 8 run it in the scalar form)."""
    t = inputs(batch, k_heads, v_heads, dk, dv, 4, seed=dk + dv)
    t["mixed"].view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 3e38]).bfloat16()
    t["conv"].view(-1)[5:8] = torch.tensor([float("-inf"), -0.0, 1e-40]).bfloat16()
    wide = torch.zeros(*t["conv"].shape[:2], 4, dtype=torch.bfloat16)
    wide[..., :3] = t["conv"]
    strided = wide[..., :3]  # channel stride 4, not 3
    assert strided.stride(1) == 4
    rec_a, rec_b = t["rec"].clone(), t["rec"].clone()
    contiguous = t["conv"].clone()
    got = fused(t, contiguous, rec_a, body=body)
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}  # NaN's bits compare equal, NaN does not

    def same_bits(a, b):
        return torch.equal(a.contiguous().view(bits[a.dtype]), b.contiguous().view(bits[b.dtype]))

    assert got.isnan().any() and same_bits(got, fused(t, strided, rec_b, body=body))
    assert same_bits(contiguous, strided) and same_bits(rec_a, rec_b)


@per_body
def test_fused_decode_rows_do_not_depend_on_the_batch(body):
    t = inputs(3, 2, 4, 16, 16, 4, seed=11)
    whole = fused(t, t["conv"].clone(), t["rec"].clone(), body=body)
    for i in range(3):
        one = {name: (v[i:i + 1] if isinstance(v, torch.Tensor) and name not in ("weight", "A_log", "dt_bias", "norm")
                      else v) for name, v in t.items()}
        assert torch.equal(fused(one, one["conv"].clone(), one["rec"].clone(), body=body), whole[i:i + 1])


@per_path
def test_engine_decodes_bf16_with_the_fused_op_like_the_reference_kernels(checkpoints, path):
    op()
    bf16_decode_against_reference(checkpoints["qwen3_next"][0], {"gdn_decode_op": ops.CpuOp(cpu_gdn.op_for, path)},
                                  {"gdn_decode_op": gdn.no_decode_op}, exact=False, cpu_isa=path)


@per_path
def test_fused_op_is_only_offered_for_bf16_on_cpu(path):
    bf, fp = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
    assert cpu_gdn.op_for(fp, bf, path) is None and cpu_gdn.op_for(bf, fp, path) is None
    if callable(cpu_gdn.load()):
        assert cpu_gdn.op_for(bf, bf, path) is cpu_gdn.op_for(bf, path) is not None


def test_the_path_none_runs_the_reference_kernels_in_bf16(checkpoints):
    """`--cpu-isa none` (or a CPU without AVX2, or not x86): no compiled op, the reference's gdn_decode_op."""
    llm = LLM(model=str(checkpoints["qwen3_next"][0]), dtype="bfloat16", device="cpu", kv_cache_gib=0.01,
              state_cache_gib=0.01, cpu_isa="none")
    assert llm.engine.cpu_path == "none" and llm.engine.model.kernels is ops.REFERENCE


def test_no_decode_op_keeps_bf16_decode_on_the_reference_kernels(checkpoints):
    """The Kernels field value of the reference (and of decode_bench's `-unfused` layouts and the test above): with
    it every bf16 decode token runs the reference recurrent step, with a CPU path's fused op none."""
    op()
    path, _ = checkpoints["qwen3_next"]
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return recurrent_gated_delta_rule(*args)

    def decode_steps(gdn_decode_op):
        llm = LLM(model=str(path), dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01)
        kernels = llm.engine.model.kernels
        llm.engine.model.kernels = dataclasses.replace(kernels, gdn_decode_op=gdn_decode_op,
                                                       recurrent_gated_delta_rule=counted)
        calls.clear()
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        return len(calls)

    gdn_layers = sum(t == "linear_attention" for t in _layer_types(path))
    assert decode_steps(gdn.no_decode_op) == 3 * gdn_layers  # 4 tokens: the first comes from prefill
    assert decode_steps(ops.CpuOp(cpu_gdn.op_for, COMPILED[-1])) == 0


def _layer_types(path) -> list[str]:
    import json

    raw = json.loads((path / "config.json").read_text())
    return (raw.get("text_config") or raw)["layer_types"]


def test_fused_op_falls_back_to_the_reference_in_one_line_when_it_does_not_build(caplog, monkeypatch, tmp_path):
    failed_build(cpu_gdn, monkeypatch, tmp_path, "fused GDN decode op")
    with one_warning_line(caplog, cpu_gdn):
        bf = torch.zeros(2, dtype=torch.bfloat16)
        assert cpu_gdn.op_for(bf, "avx2") is None and cpu_gdn.op_for(bf, "avx2") is None


def widest_body(path: str, flags: set[str]) -> str:
    if cpu_isa.body(path) >= 2 and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "avx512"
    return "avx2" if cpu_isa.body(path) >= 1 and {"avx2", "fma"} <= flags else "generic"


@per_path
def test_op_runs_the_widest_body_its_path_allows(path):
    """The op is compiled for AVX-512, AVX2 + FMA and baseline x86-64; a path runs the widest it allows on this CPU
    (cpu_isa.body: AVX-512 on the avx512_bf16 and amx_bf16 paths, AVX2 on the avx2 path), so the tests above ran
    each body this CPU has, forced lower where it has more."""
    op()
    assert cpu_gdn.vector_body(path) == widest_body(path, FLAGS)


@per_path
def test_decode_rows_beside_prefill_rows_in_one_step_decode_like_alone(checkpoints, path):
    """A step with decode rows (the fused op) and prefill rows (the reference kernels, gated separately): a
    short prompt decodes while a long one is still prefilling in chunks of the step budget, and both
    generate what each generates alone (tokens; log-probabilities within bf16 noise)."""
    op()
    checkpoint, _ = checkpoints["qwen3_next"]
    short, long = [5, 6, 7], torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(model=str(checkpoint), dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01,
              max_num_batched_tokens=8, cpu_isa=path)
    llm = LLM(**kw)
    steps = []
    model = llm.engine.model
    forward = model.forward

    def recorded(batch, *args):
        steps.append((batch.num_decode, batch.num_seqs))
        return forward(batch, *args)

    model.forward = recorded
    together = greedy(llm, [short, long])
    assert any(0 < nd < seqs for nd, seqs in steps)  # some step mixed decode and prefill rows
    for got, prompt in zip(together, [short, long], strict=True):
        alone = greedy(LLM(**kw), [prompt])[0]  # a fresh engine: nothing cached by the mixed run
        assert len(got.token_ids) == 6 and got.token_ids == alone.token_ids
        assert max(abs(x - y) for x, y in zip(got.logprobs, alone.logprobs, strict=True)) < 0.05
