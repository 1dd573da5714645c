"""The int8 form of cairn's AVX2 gemv kernel (`gemv_int8_packed`) and the int8 layout built on it.

The kernel is checked bit for bit against its definition (each output one sequential fp32 sum of exact
int8 x bf16 products over k, times its scale, rounded to bf16 once) on odd shapes, every tile and thread
count; the layout against ATen's int8 kernel on a tiny checkpoint, and a resumed int8 engine against a cold
one. Wherever the CPU has AVX2 + FMA (the AVX2 path is forced on AVX-512 machines too).
"""

from __future__ import annotations

import logging

import pytest
import torch

from cairn.engine.llm import LLM
from cairn.model import layout
from cairn.model.layout import Int8Linear, decode_weight_bytes, quantize
from cairn.model.loader import load_checkpoint
from cairn.ops import cpu_gemv
from cairn.request.sampling_params import SamplingParams
from tests.cpu_paths import COMPILED, ZEN3
from tests.harness import prefill

AVX2 = ZEN3  # an AVX2-only CPU's flags: its best path is avx2
pytestmark = pytest.mark.skipif("avx2" not in COMPILED, reason="the CPU lacks AVX2 + FMA")
TILES = [None, (4, 1), (3, 2), (2, 3), (1, 1), (1, 4), (1, 6)]


@pytest.fixture(scope="module")
def kernel() -> cpu_gemv.GemvKernel:
    k = cpu_gemv.load(AVX2, "avx2")
    if isinstance(k, str):
        pytest.skip(f"gemv kernel unavailable here: {k}")
    return k


def chain(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The definition: per output, the exact products summed in fp32 from k = 0 in order, times the scale."""
    products = x.float()[:, None, :] * q.float()[None]  # int8 x bf16: exact in fp32
    acc = torch.zeros(x.shape[0], q.shape[0])
    for j in range(q.shape[1]):
        acc = acc + products[:, :, j]
    return (acc * scales.float()).bfloat16()


@pytest.mark.parametrize("n, k", [(37, 45), (16, 1), (64, 130)])
def test_int8_gemv_sums_each_output_in_one_fp32_chain_times_its_scale(kernel, n, k):
    gen = torch.Generator().manual_seed(n * k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, generator=gen) * 0.02 + 1e-3).bfloat16()
    packed = cpu_gemv.pack_int8(q)
    assert packed.shape == (-(-n // 16), k, 16)
    wide = torch.randn(20, k + 3, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    try:
        for rows in (1, 2, 3, 5, 16, 20):
            x = wide[:rows, :k]  # strided rows
            want = chain(x, q, scales)
            for t in (1, 2):
                torch.set_num_threads(t)
                for tile in TILES:
                    assert torch.equal(kernel.packed_int8(x, packed, scales, n, tile), want), (rows, t, tile)
    finally:
        torch.set_num_threads(threads)


def test_int8_gemv_refuses_scales_or_a_weight_that_do_not_fit(kernel):
    q = torch.randint(-127, 128, (20, 8), dtype=torch.int8)
    packed, x = cpu_gemv.pack_int8(q), torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="scales \\[n\\] bf16"):
        kernel.packed_int8(x, packed, torch.ones(19).bfloat16(), 20)
    with pytest.raises(RuntimeError, match="scales \\[n\\] bf16"):
        kernel.packed_int8(x, packed, torch.ones(20), 20)
    with pytest.raises(RuntimeError, match="the weight Char"):
        kernel.packed_int8(x, cpu_gemv.pack(torch.randn(20, 8).bfloat16()), torch.ones(20).bfloat16(), 20)
    with pytest.raises(RuntimeError, match="n does not fit the blocks"):
        kernel.packed_int8(x, packed, torch.ones(40).bfloat16(), 40)


def test_an_int8_linear_on_the_kernel_rounds_like_aten_at_every_row_count(kernel):
    """Against the exact product of its int8 weights and scales, the kernel (one rounding) and ATen's paths
    (one rounding up to DIRECT_ROWS rows, two above) stay within bf16 rounding; a prefill's rows run the kernel
    16 at a time with the bits they get alone."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(40, 96, generator=gen) * torch.linspace(0.01, 1.0, 40)[:, None]).bfloat16()
    aten, relaid = Int8Linear(w), Int8Linear(w)
    relaid.lay_out(kernel)
    assert "weight" not in relaid._parameters and relaid.packed.dtype == torch.int8
    x = torch.randn(40, 96, generator=gen).bfloat16()
    exact = (x.double() @ aten.weight.double().T) * aten.scales.double()
    for rows in (1, Int8Linear.DIRECT_ROWS, 9, 40):
        for lin in (aten, relaid):
            err = (lin(x[:rows]).double() - exact[:rows]).abs()
            assert (err <= exact[:rows].abs() * 3 * 2 ** -8 + 1e-6).all(), (rows, lin is relaid)
    assert torch.equal(relaid(x), torch.cat([relaid(x[i:i + 1]) for i in range(40)]))


def int8_model(path, dtype: str = "bfloat16"):
    model, cfg = load_checkpoint(path, dtype, "cpu", show_progress=False)
    quantize(model, cfg, "int8", torch.device("cpu"))
    return model


def test_int8_layout_on_the_avx2_path_re_lays_the_weights_as_accurate_as_aten(checkpoints, caplog, kernel):
    path, _ = checkpoints["qwen3_5"]
    aten, relaid, exact = int8_model(path), int8_model(path), int8_model(path, "float32")
    with caplog.at_level(logging.INFO, logger="cairn.model.layout"):
        assert layout.lay_out_int8(relaid, "gemv", torch.bfloat16, torch.device("cpu"), cpu_flags=AVX2) == "int8"
    linears = [m for m in relaid.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m.kernel is not None and "weight" not in m._parameters and m.direct_rows == 16
                           for m in linears)
    assert decode_weight_bytes(relaid) >= decode_weight_bytes(aten)  # the same int8 bytes (plus a block's padding)
    assert any(f"{len(linears)} int8 linear layers on cairn's avx2 gemv (its int8 form) at every row count"
               in r.getMessage() for r in caplog.records)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    cuts = [30, 35, 36, 39]  # a prefill, then single tokens
    ref = prefill(exact, prompt, cuts)  # the int8 model in float32 activations

    def rms(model) -> float:
        return ((prefill(model, prompt, cuts).float() - ref).pow(2).mean().sqrt() / ref.std()).item()
    # measured 6.5% (the kernel) and 6.9% (ATen's) of the logits' spread: bf16 activations, not the kernel
    assert rms(relaid) <= 1.1 * rms(aten)


def test_int8_on_a_float32_model_stays_on_aten_and_says_why(checkpoints, caplog):
    path, _ = checkpoints["qwen3_5"]
    model, cfg = load_checkpoint(path, "float32", "cpu", show_progress=False)
    quantize(model, cfg, "int8", torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="cairn.model.layout"):
        layout.lay_out_int8(model, "auto", torch.float32, torch.device("cpu"), cpu_flags=AVX2)
    assert all(m.kernel is None and m.direct_rows == Int8Linear.DIRECT_ROWS
               for m in model.modules() if isinstance(m, Int8Linear))
    assert any("torch._weight_int8pack_mm up to 4 rows" in r.getMessage() and "gives plain here" in r.getMessage()
               for r in caplog.records)


def test_an_int8_bf16_engine_resumes_with_the_cold_logits_and_batches_with_the_alone_bits(sampled_logits):
    opts = dict(dtype="bfloat16", quantization="int8", weight_layout="gemv", kv_cache_gib=0.05,
                state_cache_gib=0.02, page_size=8, max_num_batched_tokens=96, max_num_seqs=4)
    if layout.choose_layout("gemv", torch.bfloat16, torch.device("cpu"))[1].isa != "avx2":
        pytest.skip("this CPU's gemv path is not AVX2: its int8 stays on ATen's kernel")
    warm = LLM(**opts, device_snapshot_gib=0.1, snapshot_interval=64)
    cold = LLM(**opts, prefix_cache=False)
    assert all(m.kernel is not None for m in warm.engine.model.modules() if isinstance(m, Int8Linear))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    first = [(i * 7) % 250 + 1 for i in range(190)]
    prompt = first + warm.generate([first], greedy)[0].token_ids + [33, 34, 35]
    sampled_logits.clear()
    out = warm.generate([prompt], greedy)[0]
    warm_rows = torch.stack(sampled_logits)
    sampled_logits.clear()
    ref = cold.generate([prompt], greedy)[0]
    assert out.cache.resume_position > 0 and out.cache.resume_position % 64 == 0
    assert out.token_ids == ref.token_ids
    assert torch.equal(warm_rows, torch.stack(sampled_logits))
    others = [[(i * k) % 240 + 1 for i in range(n)] for k, n in ((3, 50), (13, 70))]
    together = cold.generate([prompt, *others], greedy)
    assert together[0].token_ids == ref.token_ids and together[0].logprobs == ref.logprobs
