"""Weight layouts of the linear layers: how their weights are stored and multiplied, chosen at start-up.

Decode reads every weight once per step, so its speed is the weight bytes over the memory bandwidth,
provided the matmul kernel streams the weights at that speed. The layouts:

- plain: `nn.Linear` as loaded, through `F.linear`. Right for fp32, where MKL's gemv streams the
  weight at memory speed.
- packed: the weight reordered once, at start-up, into oneDNN's blocked layout for the CPU's matrix
  units (AMX / AVX512-BF16), multiplied with `torch.ops.mkldnn._linear_pointwise` (the call inductor
  emits for frozen bf16 linears). A bf16 `F.linear` hands oneDNN the [out, in] weight as it lies and
  oneDNN re-blocks it inside every call; packed, the call only streams it. One packed weight serves
  every batch size (prefill included).
- gemv: the weight as loaded, multiplied by cairn's own bf16 gemv kernel (cairn/ops/cpu_gemv.py: AMX
  tiles where the CPU has AMX-BF16, else AVX512-BF16 or AVX2 + FMA dot products) up to the kernel's
  `direct_rows` (16 on every path), by F.linear above (prefill keeps
  the matmul and the same weight tensor: no second copy), but on the AVX2 path, where F.linear's bf16 is
  ATen's slow fallback GEMM, by the kernel 16 rows at a time. On that path the weights are re-laid at
  start-up into the kernel's packed 16-row blocks (`cpu_gemv.pack`), which replace the loaded parameters
  (a tied lm_head, whose weight is the embedding table, and a weight its module reads itself stay as
  loaded, on the row-major kernel). Each output of the kernel is a fixed-order sum over its own row, so a
  token gets the same outputs in a decode batch of any size.
- int8 (`--quantization int8`): weight-only, symmetric, one scale per output channel (half the bytes of
  bf16). Where the gemv layout would take the AVX2 path, the int8 weights are re-laid into the kernel's
  16-row blocks and every row runs its int8 form (`lay_out_int8`); elsewhere they are multiplied with
  `torch._weight_int8pack_mm` up to `Int8Linear.DIRECT_ROWS` rows, and larger batches (prefill) convert
  the int8 weight to the activation dtype and scale the output.

`auto` picks gemv for bf16 weights where the kernel builds on a CPU with AMX-BF16 or AVX512-BF16, or
with AVX2 + FMA where oneDNN has no bf16 matmul (CPUs without AVX-512: most AMD before Zen 4, many
laptops), and plain otherwise (fp32: MKL's gemv already streams at memory speed; fp16; CUDA; an
AVX-512 CPU without AVX512-BF16, where F.linear has oneDNN's bf16 and the kernel's AVX2 path was not
measured against it, runs that path only when asked for); the choice, and why gemv was not taken, is
logged in one line. Measured (gemv_bench.py): on AVX512-BF16 the kernel streams the 0.8B model's
weights at batch 1 faster than F.linear and the packed layout; on an AVX2-only CPU F.linear's bf16
falls back to ATen's own GEMM, whose cost grows with every row of x, and the kernel's AVX2 path is
faster at every decode batch size (BENCHMARKS.md, "Decode speed in bf16": gemv against plain on
Zen 3). The packed layout was slower than plain at batch 1 and 4 on a quiet 2-core Xeon with AMX
(7.1 against 9.2 tok/s at batch 1) and stays a choice (`--weight-layout packed`).

Quantization changes the model's numbers, so it is applied before the prefix cache digests the
weights (a disk cache of the float model is not resumed by the int8 one); the layouts keep the
weights' values (their products differ from plain within bf16 rounding), and are applied after, so
the digest, taken from the parameters as loaded, does not depend on the layout (the AVX2 gemv path's
re-laid linears have no `weight` parameter after it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cairn.config import ConfigError
from cairn.model.config import ModelConfig
from cairn.ops import cpu_gemv, cpu_isa

log = logging.getLogger(__name__)

LAYOUTS = ("auto", "plain", "packed", "gemv")
QUANTIZATIONS = ("none", "int8")


class QuantizationError(ConfigError):
    """--quantization asks for something not implemented for this model or device (an option's value cairn
    cannot run with: the command line prints it as one line)."""


class PackedLinear(nn.Module):
    """y = x W^T with W held in oneDNN's blocked layout (no bias: the Qwen hybrid linears have none)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # the batch-size hint only guides oneDNN's choice of blocking; the packed weight serves any batch
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, None, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


class GemvLinear(nn.Module):
    """y = x W^T: cairn's gemv kernel up to `kernel.direct_rows` rows (decode), F.linear above (on the AVX2
    path, the kernel MAX_ROWS rows at a time: `GemvKernel.slices_prefill`); no bias.

    Up to that many rows the kernel streams the weight once for all of them; above, a GEMM. Every path takes
    16 (cpu_gemv.MAX_ROWS), so a token's outputs are bit for bit the same alone or in a decode batch of up to
    16, which F.linear's oneDNN does not give (its one-row product sums in another order than its two-row one).
    Measured (docs/kernels.md, the gemv kernel alone): the AMX path reads a step's weights at 89-100% of `sum`
    at 1 to 16 rows (1.5x F.linear at 16); on a Zen 4 the AVX512-BF16 path beats F.linear at every row count
    from 1 to 16 (1.9x at 1, 1.2x at 16; gemv_bench.py). Those two paths take W as loaded: `weight` is the very
    parameter (a tied lm_head stays tied to the embedding).

    On the AVX2 path (`kernel.packs`), chosen where F.linear's bf16 is ATen's fallback GEMM, every row runs
    the kernel: decode batches of any size and a prefill, MAX_ROWS rows at a time. There the weight is re-laid
    once into the kernel's packed blocks (`cpu_gemv.pack`, the outer-product form; its kernel alone on Zen 3:
    docs/kernels.md), held as the `packed` buffer, which replaces the parameter (no second copy); every row's
    outputs are one sequential fp32 sum per output, the same bits in a prefill, alone or in a batch. `pack=False`
    keeps W as loaded on that path too, in the row-major kernel at every row count (each output a fixed-order
    sum over its own row alone, so also the same bits at any row count): apply_layout passes it for a weight
    that is also read elsewhere (a tied lm_head's embedding, a weight its module reads itself).
    """

    def __init__(self, weight: nn.Parameter, kernel: cpu_gemv.GemvKernel, pack: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.direct_rows = kernel.direct_rows
        self.packs = pack and kernel.packs
        if self.packs:
            self.register_buffer("packed", cpu_gemv.pack(weight), persistent=False)
            return
        if not weight.is_contiguous():
            weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.weight = weight  # the very parameter (a tied lm_head stays tied to the embedding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this ~100 times (the 0.8B model: 109), so its rows go straight to the kernel, and
        # the weight is read from the module's own dicts: nn.Module.__getattr__ costs about a microsecond a call.
        decode_rows = x.dim() == 2 and x.shape[0] <= self.direct_rows and x.stride(1) == 1
        if self.packs:
            if decode_rows:
                return self.kernel.library.gemv_packed(x, self._buffers["packed"], self.out_features, 0, 0)
            return self._forward_packed(x)
        if decode_rows:
            return self.kernel(x, self._parameters["weight"])
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > self.direct_rows and not self.kernel.slices_prefill:
            return F.linear(x, self.weight)
        y = _in_slices(lambda r: self.kernel(r, self.weight), rows)  # above direct_rows: a prefill on the AVX2 path
        return y.view(*x.shape[:-1], self.out_features)

    def decode_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward's decode-row path as one pre-bound call, for a decode plan (cairn/model/decode_plan.py): x [n, K]
        with n <= direct_rows and a contiguous last dimension -> [n, N]; the same kernel call as forward's."""
        if self.packs:
            gemv, packed, n = self.kernel.library.gemv_packed, self.packed, self.out_features
            return lambda x: gemv(x, packed, n, 0, 0)
        kernel, weight = self.kernel, self.weight
        return lambda x: kernel(x, weight)

    def _forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        y = _in_slices(lambda r: self.kernel.packed(r, self.packed, self.out_features), x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """Weight-only int8: W ~= q * scale[:, None], q in [-127, 127], one scale per output row.

    The scales are kept in the activation dtype and chosen representable in it (rounded up), so the
    only error is the rounding of q. Both are parameters, so the cache's weight digest covers them.

    Multiplied by ATen's `torch._weight_int8pack_mm` up to DIRECT_ROWS rows, above by converting q to the
    activation dtype and scaling the output; or, once `lay_out` gave it the AVX2 gemv kernel (bf16 on a CPU
    where `choose_layout` takes that path), by the kernel's int8 form at every row count, MAX_ROWS rows at a
    time, on q re-laid into its packed blocks (`cpu_gemv.pack_int8`, replacing the parameter): each output one
    sequential fp32 sum over k times its scale, the same bits in a prefill, alone or in a batch.
    """

    DIRECT_ROWS = 4  # up to this many rows, ATen's fused int8 kernel; above, convert and multiply

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        scale_t = scale.to(weight.dtype)
        scale_t = torch.where(scale_t.float() < scale, torch.nextafter(scale_t, torch.full_like(scale_t, 1e30)),
                              scale_t)  # round up, so no weight is clipped
        q = torch.round(w / scale_t.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(scale_t, requires_grad=False)
        self.kernel: cpu_gemv.GemvKernel | None = None

    def lay_out(self, kernel: cpu_gemv.GemvKernel) -> None:
        """Multiply on the AVX2 gemv kernel (`kernel.packs`) from now on: q re-laid into its int8 blocks."""
        self.register_buffer("packed", cpu_gemv.pack_int8(self.weight), persistent=False)
        del self.weight
        self.kernel = kernel

    @property
    def direct_rows(self) -> int:
        return cpu_gemv.MAX_ROWS if self.kernel is not None else self.DIRECT_ROWS

    def decode_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward's fused-kernel path as one pre-bound call, for a decode plan (cairn/model/decode_plan.py): x [n, K]
        with n <= direct_rows and contiguous rows -> [n, N]; the same kernel call as forward's."""
        scales = self.scales
        if self.kernel is not None:
            gemv, packed, n = self.kernel.library.gemv_int8_packed, self.packed, self.out_features
            return lambda x: gemv(x, packed, scales, n, 0, 0)
        weight = self.weight
        return lambda x: torch._weight_int8pack_mm(x, weight, scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None:
            y = _in_slices(lambda r: self.kernel.packed_int8(r, self.packed, self.scales, self.out_features), rows)
        elif rows.shape[0] <= self.DIRECT_ROWS:
            y = torch._weight_int8pack_mm(rows.contiguous(), self.weight, self.scales)
        else:
            y = F.linear(rows, self.weight.to(x.dtype)) * self.scales
        return y.view(*x.shape[:-1], self.out_features)


def _in_slices(call: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """call(rows) cpu_gemv.MAX_ROWS rows at a time (a prefill on the AVX2 kernel: a slice's x, widened to fp32,
    stays in L2), on rows with a contiguous last dimension (the kernels' requirement)."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    step = cpu_gemv.MAX_ROWS
    if rows.shape[0] <= step:
        return call(rows)
    return torch.cat([call(rows[i:i + step]) for i in range(0, rows.shape[0], step)])


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) of every plain bias-free nn.Linear in the model."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.bias is None]


def _replace(model: nn.Module, make) -> int:
    """Replace every linear by make(weight, shared): `shared` says the weight is read elsewhere too (a tied
    lm_head's embedding, or a name in its parent module's READS_LINEAR_WEIGHTS). One at a time, so that a
    layout that re-lays a weight frees each original before making the next."""
    found = _linears(model)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    count = len(found)
    while found:
        parent, name, lin = found.pop()
        shared = uses[id(lin.weight)] > 1 or name in getattr(parent, "READS_LINEAR_WEIGHTS", ())
        setattr(parent, name, make(lin.weight, shared))
        del lin
    return count


def check_quantization(cfg: ModelConfig, method: str, device: torch.device | None = None) -> None:
    """Raise QuantizationError (one line) where `--quantization method` is not implemented for this model, or
    for `device` when given (the command line checks the model before loading it, the device unknown yet)."""
    if method == "none":
        return
    if method not in QUANTIZATIONS:
        raise QuantizationError(f"--quantization {method}: unknown (choose from {', '.join(QUANTIZATIONS)})")
    if device is not None and device.type != "cpu":
        raise QuantizationError(f"--quantization {method} is implemented for CPU only, not {device.type}")
    if cfg.moe_layers and any(cfg.moe_layers):
        raise QuantizationError(f"--quantization {method} is not implemented for MoE models ({cfg.family})")


def quantize(model: nn.Module, cfg: ModelConfig, method: str, device: torch.device) -> None:
    """Apply `--quantization`; raise QuantizationError (one line) where it is not implemented."""
    check_quantization(cfg, method, device)
    if method == "none":
        return
    n = _replace(model, lambda w, shared: Int8Linear(w))
    log.info("weights: %d linear layers quantized to int8 (weight-only, per output channel)", n)


def onednn_has_bf16() -> bool:
    """Whether F.linear's bf16 runs on oneDNN here (AVX-512 and up); else ATen's fallback GEMM does it."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_layout(requested: str, dtype: torch.dtype, device: torch.device, cpu_flags: set[str] | None = None,
                  build_dir: str | None = None, onednn_bf16: bool | None = None, cpu_path: str | None = None,
                  path_forced: bool = False) -> tuple[str, cpu_gemv.GemvKernel | None, str]:
    """(layout, the gemv kernel when chosen, why gemv was not chosen: "" when it was or was not a candidate).

    `auto` -> gemv for bf16 where the kernel loads, on an AMX-BF16 or AVX512-BF16 CPU or on an AVX2 + FMA
    one whose oneDNN has no bf16 matmul; else plain (module docstring); packed only when asked, on a CPU
    whose oneDNN has it. A gemv that cannot load (no compiler, a CPU without the instructions) falls back
    to plain, asked for or not. `cpu_path`: the instruction path (cpu_isa.PATHS; None: the best `cpu_flags`
    allow), the gemv's path; `none` keeps plain. `path_forced`: the path was asked for (--cpu-isa): a forced
    avx2 then takes the AVX2 gemv as on a CPU whose oneDNN has no bf16, so the path runs what it runs there.
    `cpu_flags` / `build_dir` / `onednn_bf16` are for tests that force a machine or the fallback (None:
    /proc/cpuinfo, torch's extensions directory, onednn_has_bf16()).
    """
    if requested not in LAYOUTS:
        raise ConfigError(f"--weight-layout {requested}: unknown (choose from {', '.join(LAYOUTS)})")
    if requested == "packed":
        supported = device.type == "cpu" and torch.backends.mkldnn.is_available() and (
            (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
            or (dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()))
        if not supported:
            raise ConfigError(f"--weight-layout packed needs bf16 / fp16 weights on a CPU with oneDNN support "
                              f"(here {dtype} on {device.type})")
        return "packed", None, ""
    gemv_fits = device.type == "cpu" and dtype == torch.bfloat16
    if requested == "gemv" and not gemv_fits:
        raise ConfigError(f"--weight-layout gemv needs bf16 weights on a CPU (here {dtype} on {device.type})")
    if requested == "plain" or not gemv_fits:
        return "plain", None, ""
    flags = cpu_isa.cpu_flags() if cpu_flags is None else cpu_flags
    path = cpu_path or cpu_isa.best_path(flags)
    if path == "none":  # asked for, or a CPU without AVX2 + FMA or not x86: no compiled op
        return "plain", None, "the CPU path is none (no compiled op)" if cpu_path else cpu_gemv.load(flags)
    onednn = onednn_has_bf16() if onednn_bf16 is None else onednn_bf16
    if requested == "auto" and path == "avx2" and onednn and not path_forced:
        return "plain", None, ("the CPU lacks avx512_bf16 and F.linear has oneDNN's bf16 (the kernel's AVX2 path "
                               "only when asked: --weight-layout gemv or --cpu-isa avx2)")
    # a path found, not asked for, lets the kernel step down from AMX where the OS does not grant its tiles
    kernel = cpu_gemv.load(flags, isa=path if path_forced else None, build_dir=build_dir)
    if isinstance(kernel, str):
        return "plain", None, kernel
    return "gemv", kernel, ""


def apply_layout(model: nn.Module, requested: str, dtype: torch.dtype, device: torch.device,
                 cpu_flags: set[str] | None = None, build_dir: str | None = None, cpu_path: str | None = None,
                 path_forced: bool = False) -> str:
    """Lay the remaining plain linears out as chosen; returns the choice and logs it in one line."""
    layout, kernel, not_gemv = choose_layout(requested, dtype, device, cpu_flags, build_dir, cpu_path=cpu_path,
                                             path_forced=path_forced)
    n = 0
    if layout == "packed":
        n = _replace(model, lambda w, shared: PackedLinear(w))
    elif layout == "gemv":
        n = _replace(model, lambda w, shared: GemvLinear(w, kernel, pack=not shared))
    flags = " ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in cpu_isa.cpu_flags())
    done = {"packed": f", {n} linear layers packed",
            "gemv": _gemv_done(model, n, kernel) if kernel else ""}.get(layout, "")
    why = f"; gemv kernel not used: {not_gemv}" if not_gemv else ""
    (log.warning if not_gemv and requested == "gemv" else log.info)(
        "weight layout: %s (%s, %s%s; --weight-layout %s)%s%s", layout, dtype, device.type,
        f" with {flags}" if flags else "", requested, done, why)
    return layout


def lay_out_int8(model: nn.Module, requested: str, dtype: torch.dtype, device: torch.device,
                 cpu_flags: set[str] | None = None, build_dir: str | None = None, cpu_path: str | None = None,
                 path_forced: bool = False) -> str:
    """The layout of a model `quantize` made int8: where `choose_layout` takes the AVX2 gemv path (bf16, a CPU
    without AVX512-BF16 whose F.linear has no oneDNN bf16, or `--weight-layout gemv` asked), its linears move
    to the kernel's int8 form (`Int8Linear.lay_out`); elsewhere they stay on ATen's int8 kernel. Returns "int8"
    and logs the choice in one line."""
    layout, kernel, not_gemv = choose_layout(requested, dtype, device, cpu_flags, build_dir, cpu_path=cpu_path,
                                             path_forced=path_forced)
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    if kernel is not None and kernel.packs:
        for m in linears:
            m.lay_out(kernel)
        mb = sum(m.packed.numel() for m in linears) / 1e6
        how = (f"cairn's avx2 gemv (its int8 form) at every row count, re-laid into 16-row blocks ({mb:.1f} MB, "
               f"replacing the loaded weights)")
    else:
        why = not_gemv or (f"the {kernel.isa} gemv has no int8 form" if kernel
                           else f"--weight-layout {requested} gives {layout} here")
        how = f"torch._weight_int8pack_mm up to {Int8Linear.DIRECT_ROWS} rows, F.linear above (not cairn's gemv: {why})"
    log.info("weight layout: int8 (%s, %s; --weight-layout %s), %d int8 linear layers on %s", dtype, device.type,
             requested, len(linears), how)
    return "int8"


def _gemv_done(model: nn.Module, n: int, kernel: cpu_gemv.GemvKernel) -> str:
    """The log line's account of the gemv layout: how many linears, on which path, up to how many rows; on the
    AVX2 path, how many were re-laid into packed blocks (their bytes) and how many kept W as loaded."""
    if not kernel.packs:
        return f", {n} linear layers on cairn's {kernel.isa} gemv up to {kernel.direct_rows} rows"
    packed = [m.packed for m in model.modules() if isinstance(m, GemvLinear) and m.packs]
    mb = sum(t.numel() * t.element_size() for t in packed) / 1e6
    return (f", {n} linear layers on cairn's {kernel.isa} gemv at every row count, {len(packed)} re-laid into "
            f"16-row blocks ({mb:.1f} MB, replacing the loaded weights), {n - len(packed)} kept as loaded "
            f"(read elsewhere too: a tied embedding table, a weight its module reads)")


def prefill_kernels(model: nn.Module) -> str:
    """Which kernels multiply a prefill's rows in the linears, where that is not F.linear on the weights as
    loaded ("" then): "gemv-avx2" (the AVX2 gemv path, every row, in its own order of sums), "packed" (oneDNN's
    blocked weights), "int8" or "int8-gemv-avx2" (joined by "+" where several are present). A snapshot computed
    under one of these is not bit for bit what a prefill under another computes, so exact resumption keeps them
    apart in the compatibility digest (cairn/engine/compat.py). The AMX and AVX512-BF16 gemv paths take decode rows
    only, and a prefill's go to F.linear: those count as plain."""
    kinds = set()
    for m in model.modules():
        if isinstance(m, GemvLinear) and m.kernel.slices_prefill:
            kinds.add(f"gemv-{m.kernel.isa}")
        elif isinstance(m, PackedLinear):
            kinds.add("packed")
        elif isinstance(m, Int8Linear):
            kinds.add("int8" if m.kernel is None else f"int8-gemv-{m.kernel.isa}")
    return "+".join(sorted(kinds))


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and packed weight except the embedding
    table (one row per token); a tied lm_head (named after it) still counts whole."""
    seen, total = set(), 0
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        if id(t) in seen or name == "embed.weight":
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
