"""cairn's bf16 gemv kernel (cairn/ops/cpu_gemv.py) and the gemv weight layout built on it.

The kernel is compared with its reference (F.linear) and an fp64 product on random shapes, odd
sizes included, on each instruction path this CPU has; the layout with the plain one on a tiny checkpoint; the fallback
to plain is forced (a CPU without the instructions, a compiler that does not exist).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from cairn.engine.llm import LLM
from cairn.model import layout
from cairn.model.layout import GemvLinear, decode_weight_bytes
from cairn.model.loader import load_checkpoint
from cairn.ops import cpu_gemv, cpu_isa
from cairn.request.sampling_params import SamplingParams
from tests.cpu_paths import BEST, COMPILED, FLAGS, ICELAKE, OLD_X86, SAPPHIRE_RAPIDS, ZEN3, ZEN4
from tests.harness import prefill

ISAS = COMPILED[::-1]  # every compiled path this CPU runs, its best first
needs_kernel = pytest.mark.skipif(not ISAS, reason="the CPU has neither AVX512-BF16 nor AVX2 + FMA")


def kernel(isa: str) -> cpu_gemv.GemvKernel:
    k = cpu_gemv.load(FLAGS, isa)
    if isinstance(k, str):
        pytest.skip(f"gemv kernel unavailable here: {k}")
    return k


def within_bf16_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """|got - x w^T| within one bf16 rounding of the exact value plus fp32 accumulation over K terms."""
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    bound = 2.0 ** -8 * exact.abs() + x.shape[1] * 2.0 ** -23 * scale + 1e-30
    return bool(((got.double() - exact).abs() <= bound).all())


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n, k", [(1, 1), (3, 7), (5, 31), (37, 33), (130, 100), (64, 1030), (9, 64)])
def test_gemv_equals_f_linear_within_bf16_rounding_on_odd_shapes(isa, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    for m in (1, 2, 3, 4, 5, 8, 16):
        x = torch.randn(m, k, generator=gen).bfloat16()
        got, ref = kernel(isa)(x, w), F.linear(x, w)  # F.linear: what the layout runs without the kernel
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert within_bf16_rounding(got, x, w) and within_bf16_rounding(ref, x, w)
        # the two differ by at most one bf16 step of their magnitude (one rounding each)
        assert ((got.float() - ref.float()).abs() <= 2.0 ** -7 * ref.float().abs() + 1e-3).all()


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_gemv_row_outputs_do_not_depend_on_the_other_rows_or_the_threads(isa):
    """A token's outputs are the same alone, in a batch of 16, at one thread or two, from a strided view."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(1000, 300, generator=gen).bfloat16()
    x = torch.randn(16, 300, generator=gen).bfloat16()
    k = kernel(isa)
    whole = k(x, w)
    for i in (0, 5, 15):
        assert torch.equal(k(x[i:i + 1], w), whole[i:i + 1])
    assert torch.equal(k(x[3:7], w), whole[3:7])
    wide = torch.randn(16, 600, generator=gen).bfloat16()
    wide[:, :300] = x
    assert torch.equal(k(wide[:, :300], w), whole)  # rows with a stride of 600
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(k(x, w), whole)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_gemv_row_outputs_do_not_depend_on_the_tile_that_holds_the_row(isa):
    """Weight rows are walked in tiles whose height depends on the rows of x (8, 4 or 2 on AVX2; 16, 8 or 4
    on AVX512-BF16), the last n % height rows one at a time, and K in chunks with a zero-padded tail: a
    weight row's outputs are the same bits whether it sat in a whole tile or in the remainder."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(1003, 1030, generator=gen).bfloat16()  # 1003 rows: a remainder for every tile height
    x = torch.randn(16, 1030, generator=gen).bfloat16()  # 1030 = 64 x 16 + 6: a K tail on every path
    k = kernel(isa)
    whole = k(x, w)
    for m in range(1, 16):
        assert torch.equal(k(x[:m], w), whole[:m])
        assert torch.equal(k(x[m:m + 1], w), whole[m:m + 1])
    assert torch.equal(k(x, w[997:]), whole[:, 997:])  # the last rows as the whole weight: full tiles now


def avx2_kernel() -> cpu_gemv.GemvKernel:
    if "avx2" not in ISAS:
        pytest.skip("the CPU lacks AVX2 + FMA")
    return kernel("avx2")


@pytest.mark.parametrize("n, k", [(1, 1), (3, 7), (5, 31), (37, 33), (130, 100), (64, 1030), (9, 64), (17, 3)])
def test_packed_gemv_equals_f_linear_within_bf16_rounding_on_odd_shapes(n, k):
    """The AVX2 path's packed weight: N not a multiple of 16 (a zero-padded last block whose padded outputs
    are never written), odd K, and more rows than a decode batch (a prefill slice)."""
    kern = avx2_kernel()
    gen = torch.Generator().manual_seed(n * 1000 + k + 7)
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = cpu_gemv.pack(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.is_contiguous()
    for m in (1, 2, 3, 4, 5, 7, 8, 13, 16, 23):
        x = torch.randn(m, k, generator=gen).bfloat16()
        got, ref = kern.packed(x, packed, n), F.linear(x, w)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert within_bf16_rounding(got, x, w)
        assert ((got.float() - ref.float()).abs() <= 2.0 ** -7 * ref.float().abs() + 1e-3).all()


def test_packed_gemv_sums_each_output_in_one_sequential_fp32_chain_over_k():
    """Each output is fma(w[k], x[k], acc) for k = 0, 1, ... from acc = 0 in fp32, then one rounding to bf16:
    the kernel's bits equal that chain computed here (fp64 holds each bf16 x bf16 product exactly, so
    rounding product + acc to fp32 is the FMA's single rounding)."""
    kern = avx2_kernel()
    gen = torch.Generator().manual_seed(21)
    n, k, m = 37, 45, 5
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    acc = torch.zeros(m, n, dtype=torch.float32)
    for j in range(k):
        acc = (acc.double() + x[:, j].double()[:, None] * w[:, j].double()[None, :]).float()
    assert torch.equal(kern.packed(x, cpu_gemv.pack(w), n), acc.bfloat16())


def test_packed_gemv_row_outputs_do_not_depend_on_the_rows_the_tile_or_the_threads():
    """A row's outputs on the AVX2 path are the same bits alone, in a batch of any size up to 16 and beyond,
    under every tile (blocks side by side x rows per pass), at one thread or two, and from a strided view."""
    kern = avx2_kernel()
    gen = torch.Generator().manual_seed(5)
    n, k = 1003, 1030  # 1003: a padded last block, and a remainder of blocks for every tile width
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = cpu_gemv.pack(w)
    x = torch.randn(20, k, generator=gen).bfloat16()
    whole = kern.packed(x, packed, n)
    for m in range(1, 17):
        assert torch.equal(kern.packed(x[:m], packed, n), whole[:m])
        assert torch.equal(kern.packed(x[m:m + 1], packed, n), whole[m:m + 1])
    for tile in [(4, 1), (3, 2), (2, 3), (2, 2), (1, 4), (1, 5), (1, 6), (1, 1)]:
        assert torch.equal(kern.packed(x, packed, n, tile), whole), tile
    with pytest.raises(RuntimeError, match="no tile"):
        kern.packed(x, packed, n, (4, 2))
    wide = torch.randn(20, 2 * k, generator=gen).bfloat16()
    wide[:, :k] = x
    assert torch.equal(kern.packed(wide[:, :k], packed, n), whole)  # rows with a stride of 2K
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kern.packed(x, packed, n), whole)
        torch.set_num_threads(2)
        assert torch.equal(kern.packed(x, packed, n), whole)
    finally:
        torch.set_num_threads(threads)


def test_packed_gemv_refuses_a_weight_count_that_does_not_fit_its_blocks():
    kern = avx2_kernel()
    w = torch.randn(37, 8).bfloat16()
    x = torch.randn(1, 8).bfloat16()
    for n in (32, 49):  # 37 rows make 3 blocks: 33..48 outputs fit them
        with pytest.raises(RuntimeError, match="does not fit"):
            kern.packed(x, cpu_gemv.pack(w), n)
    assert kern.packed(x, cpu_gemv.pack(w), 37).shape == (1, 37)


@needs_kernel
def test_stream_read_reads_every_whole_line_of_the_buffer():
    """The benchmarks' own memory read: its checksum is the sum of the buffer's 64-bit words in whole
    64-byte lines, so it read all of them (and a trailing partial line is left out)."""
    k = kernel(ISAS[0])
    buf = torch.arange(3 * 8 * 1001 + 5, dtype=torch.int64)  # 3003 lines (an odd count) and 5 words
    assert k.stream_read(buf) == int(buf[:24024].sum())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert k.stream_read(buf) == int(buf[:24024].sum())
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_gemv_layout_gives_the_plain_logits_and_keeps_the_weights(checkpoints):
    """The layout keeps every weight it does not re-lay (the very tensors), and the one it re-lays (the AVX2
    path's packed blocks) replaces its parameter, so the weights are held once; the logits stay within bf16
    rounding of plain's."""
    path, _ = checkpoints["qwen3_next"]
    plain, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    fast, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    before = {name: p.data_ptr() for name, p in fast.named_parameters()}
    assert layout.apply_layout(fast, "gemv", torch.bfloat16, torch.device("cpu")) == "gemv"
    linears = {name: m for name, m in fast.named_modules() if isinstance(m, GemvLinear)}
    assert linears
    after = {name: p.data_ptr() for name, p in fast.named_parameters()}
    assert all(before[name] == ptr for name, ptr in after.items())  # the weights, not copies
    packed = {name for name, m in linears.items() if m.packs}
    assert packed == (set(linears) if linears[next(iter(linears))].kernel.packs else set())
    assert {f"{name}.weight" for name in packed} == set(before) - set(after)  # re-laid: the parameter is gone
    padding = sum((m.packed.shape[0] * 16 - m.out_features) * m.in_features * 2 for m in fast.modules()
                  if isinstance(m, GemvLinear) and m.packs)
    assert decode_weight_bytes(fast) == decode_weight_bytes(plain) + padding  # the padded rows are read too
    prompt = [int(t) for t in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))]
    cuts = [30, 35, 36, 37, 38]  # a 30-token piece, 5 rows, then single tokens
    ref, got = prefill(plain, prompt, cuts), prefill(fast, prompt, cuts)
    assert (got - ref).abs().max().item() < 0.02 * ref.std().item()


def test_gemv_layout_on_the_avx2_path_keeps_a_tied_lm_head_on_the_embedding(checkpoints):
    """A tied lm_head's weight is the embedding table: the AVX2 path does not re-lay it (a packed copy would
    hold the table twice) but runs it on the row-major kernel at every row count, so its logits are still
    the same bits for a token in a prefill, alone or in a batch, and the embedding stays tied."""
    avx2_kernel()
    path, _ = checkpoints["falcon_h1_tied"]
    plain, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    model, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    assert model.lm_head.weight is model.embed.weight
    layout.apply_layout(model, "gemv", torch.bfloat16, torch.device("cpu"), cpu_flags=ZEN3)
    head = model.lm_head
    assert isinstance(head, GemvLinear) and not head.packs and head.weight is model.embed.weight
    assert all(m.packs for m in model.modules() if isinstance(m, GemvLinear) and m is not head)
    assert decode_weight_bytes(model) >= decode_weight_bytes(plain)  # the table counted once, whole
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(20, head.in_features, generator=gen).bfloat16()
    whole = head(x)
    assert all(torch.equal(head(x[i:i + 1]), whole[i:i + 1]) for i in range(20))
    assert torch.equal(head(x[:5]), whole[:5])
    ref = F.linear(x, model.embed.weight).float()
    assert ((whole.float() - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-3).all()


def test_gemv_layout_on_the_avx2_path_keeps_a_weight_its_module_reads_itself(checkpoints):
    """Nemotron-H's routed MoE reads `router.weight` itself (an fp32 product): the AVX2 path keeps that linear
    as loaded, re-lays the others, and the model's logits stay within bf16 rounding of the same layout with
    every weight as loaded (the row-major kernel). Not of plain's: in this tiny MoE a bf16 rounding of a
    router input flips an expert choice (plain against the row-major kernel: 0.3 where the logits' std is 0.4)."""
    kern = avx2_kernel()
    path, _ = checkpoints["nemotron_h"]
    plain, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    layout._replace(plain, lambda w, shared: GemvLinear(w, kern, pack=False))
    model, _ = load_checkpoint(path, "bfloat16", "cpu", show_progress=False)
    layout.apply_layout(model, "gemv", torch.bfloat16, torch.device("cpu"), cpu_flags=ZEN3)
    routers = [m.router for m in model.modules() if hasattr(m, "READS_LINEAR_WEIGHTS")]
    assert routers and all(isinstance(r, GemvLinear) and not r.packs and r.weight.dtype == torch.bfloat16
                           for r in routers)
    assert any(isinstance(m, GemvLinear) and m.packs for m in model.modules())
    prompt = [int(t) for t in torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(6))]
    cuts = [16, 20, 21]
    ref, got = prefill(plain, prompt, cuts), prefill(model, prompt, cuts)
    assert (got - ref).abs().max().item() < 0.02 * ref.std().item()


def test_gemv_layout_shares_the_disk_cache_namespace_only_without_exact_resumption(checkpoints, tmp_path):
    """The compatibility digest names a disk cache's namespace from the weights as loaded (taken before a layout
    re-lays them): without exact resumption a gemv layout (the AVX2 path) gives the namespace the plain layout
    gives, so either resumes the other's; with it (bf16's default prefill block) they differ, since the AVX2
    path sums a prefill's rows in its own order and a resume must be bit for bit a cold prefill here."""
    avx2_kernel()
    path, _ = checkpoints["qwen3_next"]
    for block, shared in ((0, True), (None, False)):
        names = {}
        for name in ("plain", "gemv"):
            root = tmp_path / f"{name}-{block}"
            with LLM(model=str(path), dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01,
                     disk_cache=str(root), weight_layout=name, prefill_block=block, cpu_isa="avx2") as llm:
                assert llm.engine.weight_layout == name and bool(llm.engine.prefill_block) == (block is None)
            names[name] = sorted(p.name for p in root.iterdir())
        assert len(names["plain"]) == len(names["gemv"]) == 1
        assert (names["plain"] == names["gemv"]) == shared, block


def test_gemv_falls_back_to_plain_in_one_line_on_a_cpu_without_the_instructions(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False)).bfloat16()
    with caplog.at_level(logging.INFO, logger="cairn.model.layout"):
        got = layout.apply_layout(model, "gemv", torch.bfloat16, torch.device("cpu"), cpu_flags=OLD_X86)
    assert got == "plain" and type(model[0]) is torch.nn.Linear
    lines = [r for r in caplog.records if r.name == "cairn.model.layout"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "gemv kernel not used: the CPU lacks" in lines[0].getMessage()
    assert layout.choose_layout("auto", torch.bfloat16, torch.device("cpu"), cpu_flags=OLD_X86)[0] == "plain"


def test_auto_keeps_plain_on_an_avx2_cpu_whose_onednn_has_bf16():
    """An AVX-512 CPU without AVX512-BF16: F.linear has oneDNN's bf16 there, and the kernel's AVX2 path was
    not measured against it, so auto keeps plain and says why."""
    got, kernel_, why = layout.choose_layout("auto", torch.bfloat16, torch.device("cpu"), cpu_flags=ICELAKE,
                                             onednn_bf16=True)
    assert (got, kernel_) == ("plain", None) and "F.linear has oneDNN's bf16" in why


@needs_kernel
def test_auto_takes_the_avx2_gemv_for_every_decode_row_where_onednn_has_no_bf16(caplog):
    """An AVX2-only CPU: F.linear's bf16 is ATen's fallback GEMM there, slower than the kernel at every
    decode batch, so auto takes the kernel's AVX2 path up to MAX_ROWS rows and logs it."""
    got, kernel_, why = layout.choose_layout("auto", torch.bfloat16, torch.device("cpu"), cpu_flags=ZEN3,
                                             onednn_bf16=False)
    assert got == "gemv" and kernel_.isa == "avx2" and why == ""
    assert kernel_.direct_rows == cpu_gemv.MAX_ROWS
    if BEST == "avx2" and not layout.onednn_has_bf16():  # this machine is one
        model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False)).bfloat16()
        with caplog.at_level(logging.INFO, logger="cairn.model.layout"):
            assert layout.apply_layout(model, "auto", torch.bfloat16, torch.device("cpu")) == "gemv"
        line = next(r.getMessage() for r in caplog.records if r.name == "cairn.model.layout")
        assert "on cairn's avx2 gemv at every row count, 1 re-laid into 16-row blocks" in line


@needs_kernel
def test_gemv_falls_back_to_plain_in_one_line_without_a_compiler(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False)).bfloat16()
    with caplog.at_level(logging.INFO, logger="cairn.model.layout"):
        got = layout.apply_layout(model, "auto", torch.bfloat16, torch.device("cpu"), cpu_flags=FLAGS,
                                  build_dir=str(tmp_path))
    assert got == "plain" and type(model[0]) is torch.nn.Linear
    lines = [r.getMessage() for r in caplog.records if r.name == "cairn.model.layout"]
    assert len(lines) == 1 and "gemv kernel not used: building the kernel failed" in lines[0]
    assert "\n" not in lines[0]


def test_gemv_layout_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="gemv needs bf16"):
        layout.choose_layout("gemv", torch.float32, torch.device("cpu"))
    assert layout.choose_layout("auto", torch.float32, torch.device("cpu"))[0] == "plain"
    assert layout.choose_layout("auto", torch.bfloat16, torch.device("cuda"))[0] == "plain"


def test_build_command_names_the_path_this_cpu_gets_or_why_none(capsys):
    assert cpu_gemv.main(["--build"]) == 0
    line = capsys.readouterr().out.strip()
    got = cpu_gemv.load(FLAGS)
    expected = got.isa if isinstance(got, cpu_gemv.GemvKernel) else f"none ({got})"
    assert line == f"cairn gemv kernel: {expected}"
    with pytest.raises(SystemExit):
        cpu_gemv.main([])


@needs_kernel
@pytest.mark.parametrize("path", COMPILED)
def test_gemv_decodes_a_sequence_alike_alone_and_in_a_batch_of_five(checkpoints, path):
    """On every path the kernel takes every decode batch up to 16 rows (no F.linear, whose one-row product sums in
    another order than its several-row one), and its outputs do not depend on the other rows: five greedy
    sequences decoded together get the tokens and log-probabilities each gets alone, bit for bit."""
    model, _ = checkpoints["qwen3_next"]
    llm = LLM(model=str(model), dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01,
              cpu_isa=path, weight_layout="gemv")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, GemvLinear)]
    assert linears and all(m.kernel.isa == path and m.direct_rows == cpu_gemv.MAX_ROWS for m in linears)
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 9, 12, 14, 17)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True)
    batched = llm.generate(prompts, params)
    for prompt, together in zip(prompts, batched, strict=True):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == together.token_ids and alone.logprobs == together.logprobs


def test_amx_refused_by_the_os_falls_back_to_the_avx512_bf16_path(monkeypatch):
    """Flags that promise AMX while the library finds it not granted (an old kernel, no arch_prctl
    permission): load() gives the AVX512-BF16 path, not plain F.linear; a forced amx_bf16 is refused."""
    built = []

    def fake_build(build_dir, isa):
        built.append(isa)
        return "the CPU lacks amx_bf16" if isa == "amx_bf16" else cpu_gemv.GemvKernel(None, isa)

    monkeypatch.setattr(cpu_gemv, "_build", fake_build)
    got = cpu_gemv.load(SAPPHIRE_RAPIDS, machine="x86_64")
    assert isinstance(got, cpu_gemv.GemvKernel) and got.isa == "avx512_bf16" and got.direct_rows == cpu_gemv.MAX_ROWS
    assert built == ["amx_bf16", "avx512_bf16"]
    assert cpu_gemv.load(SAPPHIRE_RAPIDS, "amx_bf16", machine="x86_64") == "the CPU lacks amx_bf16"
    assert cpu_gemv.load(ZEN4, "amx_bf16", machine="x86_64") == "the CPU lacks amx_bf16"


def test_build_command_on_a_machine_without_proc_cpuinfo_says_the_cpu_lacks_the_instructions(monkeypatch, capsys):
    """No /proc/cpuinfo (another OS, a restricted container): no flags are known, so no path is tried and
    the build command says why in one line."""
    def no_cpuinfo(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(cpu_isa, "open", no_cpuinfo, raising=False)
    assert cpu_isa.cpu_flags() == set()
    assert cpu_gemv.main(["--build"]) == 0
    assert capsys.readouterr().out.strip() == "cairn gemv kernel: none (the CPU lacks AVX2 + FMA)"


PATH_ABOVE = {"avx2": ("avx512_bf16", ZEN4), "avx512_bf16": ("amx_bf16", SAPPHIRE_RAPIDS)}


@needs_kernel
@pytest.mark.skipif(BEST not in PATH_ABOVE, reason="no path above this CPU's best")
def test_flags_promising_a_path_the_built_library_finds_missing_are_refused():
    """Flags that promise the path above this CPU's best (a hypervisor passing flags the CPU does not
    run): the library builds, its own check finds the instructions missing, and the path is refused in one
    line rather than run."""
    kernel(ISAS[0])  # built (or found built) for this CPU
    above, flags = PATH_ABOVE[BEST]
    assert cpu_gemv.load(flags, above) == f"the CPU lacks {above}"
