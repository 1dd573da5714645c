"""The weight layouts' and kernels' edge paths the model tests do not reach: a gemv layout fed more rows
than it serves directly (prefill), a non-contiguous weight or input row, a packed layout given no rows,
the refusals of an unknown layout or quantization, of int8 off the CPU and of a conv capture outside its
segment, and the kernel's build command (scripts/setup runs it). Each is compared with F.linear or
checked for the error that names the problem.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from cairn.model.layout import GemvLinear, PackedLinear, QuantizationError, choose_layout, quantize
from cairn.ops import cpu_gemv
from cairn.ops.attention import consecutive_run
from cairn.ops.conv import causal_conv1d
from tests.cpu_paths import FLAGS
from tests.server_process import REPO_ROOT


def gemv_kernel() -> cpu_gemv.GemvKernel:
    kernel = cpu_gemv.load(FLAGS)
    if isinstance(kernel, str):
        pytest.skip(f"gemv kernel unavailable here: {kernel}")
    return kernel


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_gemv_layout_above_its_direct_rows_is_f_linear():
    w = torch.nn.Parameter(bf16(37, 64, seed=1), requires_grad=False)
    layer = GemvLinear(w, cpu_gemv.GemvKernel(None, "avx512_bf16"))  # 16 rows, F.linear above: never called here
    assert not layer.kernel.slices_prefill
    x = bf16(2, layer.direct_rows + 3, 64, seed=2)  # a prefill: more rows than the kernel serves
    assert torch.equal(layer(x), F.linear(x, w))


@pytest.mark.parametrize("pack", [True, False])
def test_gemv_layout_on_the_avx2_path_runs_a_prefill_through_the_kernel_16_rows_at_a_time(pack):
    """Where the AVX2 path runs, F.linear's bf16 is ATen's slow fallback GEMM, so a prefill's rows go through
    the kernel in slices of MAX_ROWS: each row's outputs are the bits the layer gives it alone (a decode
    step), and within bf16 rounding of F.linear; with the weight re-laid into packed blocks (the default) and
    kept as loaded (`pack=False`: a tied lm_head)."""
    kernel = cpu_gemv.load(FLAGS, "avx2")
    if isinstance(kernel, str):
        pytest.skip(f"the AVX2 path is unavailable here: {kernel}")
    w = torch.nn.Parameter(bf16(37, 70, seed=8), requires_grad=False)
    layer = GemvLinear(w, kernel, pack=pack)
    assert layer.kernel.slices_prefill and layer.direct_rows == cpu_gemv.MAX_ROWS and layer.packs == pack
    assert hasattr(layer, "weight") != pack and (not pack or layer.packed.shape == (3, 70, 16))
    x = bf16(2, 20, 70, seed=9)  # 40 rows: slices of 16, 16 and 8
    got = layer(x)
    assert got.shape == (2, 20, 37)
    alone = torch.cat([layer(row.view(1, -1)) for row in x.reshape(-1, 70)]).view(2, 20, 37)
    assert torch.equal(got, alone)
    ref = F.linear(x, w).float()
    assert ((got.float() - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-3).all()


def test_gemv_layout_of_a_non_contiguous_weight_multiplies_a_contiguous_copy():
    stored = bf16(64, 37, seed=3)
    w = torch.nn.Parameter(stored.T, requires_grad=False)  # [37, 64], column-major
    kernel = gemv_kernel()
    layer = GemvLinear(w, kernel, pack=False)
    assert layer.weight.is_contiguous() and torch.equal(layer.weight, stored.T)
    x = bf16(1, 64, seed=4)
    ref = F.linear(x.float(), stored.T.float())
    assert ((layer(x).float() - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-2).all()
    if kernel.packs:  # the AVX2 path re-lays the weight as it reads it, strides and all
        packed = GemvLinear(w, kernel)
        assert torch.equal(packed(x), GemvLinear(torch.nn.Parameter(stored.T.contiguous()), kernel)(x))


def test_gemv_layout_of_a_strided_input_row_multiplies_a_contiguous_copy():
    w = torch.nn.Parameter(bf16(37, 64, seed=6), requires_grad=False)
    layer = GemvLinear(w, gemv_kernel())
    x = bf16(64, 2, seed=7).T[:1]  # one row whose elements are 2 apart
    assert x.stride(-1) != 1
    assert torch.equal(layer(x), layer(x.contiguous()))


def test_packed_layout_given_no_rows_returns_an_empty_output():
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("oneDNN without bf16 here")
    layer = PackedLinear(bf16(37, 64, seed=5))
    out = layer(torch.empty(0, 64, dtype=torch.bfloat16))
    assert out.shape == (0, 37) and out.dtype == torch.bfloat16


def test_unknown_weight_layout_and_quantization_and_int8_off_the_cpu_are_refused_naming_them():
    with pytest.raises(ValueError, match="--weight-layout tiled: unknown"):
        choose_layout("tiled", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(QuantizationError, match="--quantization int4: unknown"):
        quantize(torch.nn.Linear(4, 4), None, "int4", torch.device("cpu"))
    with pytest.raises(QuantizationError, match="implemented for CPU only, not cuda"):
        quantize(torch.nn.Linear(4, 4), None, "int8", torch.device("cuda"))  # refused before the model is read


def test_conv_capture_outside_the_segment_is_refused():
    x, state, weight = torch.randn(5, 8), torch.zeros(8, 3), torch.randn(8, 4)
    causal_conv1d(x, state.clone(), weight, capture_at=[(5, torch.empty(8, 3))])  # the segment's end: fine
    with pytest.raises(ValueError, match="capture at 6 is outside the segment's 5 tokens"):
        causal_conv1d(x, state.clone(), weight, capture_at=[(6, torch.empty(8, 3))])


def test_page_run_of_no_pages_is_none():
    assert consecutive_run(torch.tensor([], dtype=torch.long)) is None
    assert consecutive_run(torch.tensor([4, 5, 6])) == slice(4, 7)


def built_line(module: str) -> str:
    """The line `python -m cairn.ops.<module> --build` must print, from loading the op in this process."""
    if module == "cpu_gemv":
        kernel = cpu_gemv.load(FLAGS)
        return "cairn gemv kernel: " + (kernel.isa if isinstance(kernel, cpu_gemv.GemvKernel) else f"none ({kernel})")
    what = {"cpu_gdn": "fused GDN decode op", "cpu_norm": "fused add + RMSNorm op", "cpu_silu": "fused silu * up op",
            "cpu_attention": "paged decode attention op"}
    loaded = importlib.import_module(f"cairn.ops.{module}").load()
    return f"cairn {what[module]}: " + (f"none ({loaded})" if isinstance(loaded, str) else "built")


@pytest.mark.parametrize("module", ["cpu_gemv", "cpu_gdn", "cpu_norm", "cpu_silu", "cpu_attention"])
def test_op_build_commands_say_in_one_line_what_they_built(module):
    """The commands scripts/setup runs (`python -m cairn.ops.<op> --build`), as it runs them: exit 0 and one
    line, the gemv kernel's path or "built" where the op loads in this process too, else why not (a machine
    without a compiler still sets up)."""
    out = subprocess.run([sys.executable, "-m", f"cairn.ops.{module}", "--build"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    assert out.strip() == built_line(module)
