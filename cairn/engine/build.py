"""What an Engine is made of, built once at start-up: `build_parts(config)` -> EngineParts.

The order is the one the pieces need: the device; the model (a checkpoint, or the demo model) with its
tokenizer and grammar compiler; int8 quantization, before anything digests the weights; the CPU instruction
path and the kernels bound to it; the memory budgets (sizing.resolve_sizes); the decode graph path's backend,
if any; the KV pool and the working state slots; the weights' digest, before the layout re-lays them; the
weight layout; the prefix cache (handed its compatibility digest, compat.py); the scheduler and the runner;
and last the fused CPU ops, built before the server answers /health rather than mid-request.

What this is not: the engine's step (engine.py), or the sizing of the budgets (sizing.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cairn.cache.base import NullCache, PrefixCache
from cairn.cache.factory import build_cache
from cairn.config import CacheOptions, ConfigError, EngineConfig, ModelOptions, is_random_demo
from cairn.decode_graphs import CaptureBackend, DecodeGraphs
from cairn.engine.compat import compat_digest, kernel_platform, weights_digest
from cairn.engine.demo import DEMO_NAME, RANDOM_DEMO_NAME, build_demo, demo_checkpoint, is_demo
from cairn.engine.sizing import resolve_sizes
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.model.config import ModelConfig
from cairn.model.hybrid import HybridModel
from cairn.model.layout import apply_layout, lay_out_int8, prefill_kernels, quantize
from cairn.model.loader import load_checkpoint
from cairn.ops import cpu_gemv, cpu_isa, cuda_graphs, load_fused_cpu_ops, select_kernels
from cairn.ops.gdn import CHUNK_SIZE as GDN_CHUNK
from cairn.request.grammar import GrammarCompiler
from cairn.request.sampling import generation_defaults, generation_eos_ids
from cairn.request.tokenizer import HFTokenizer, Tokenizer
from cairn.runner import ModelRunner
from cairn.scheduler import Scheduler

log = logging.getLogger("cairn.engine")  # the name of the engine's log lines (README), not the module path


@dataclass
class EngineParts:
    """Everything an Engine runs on, as build_parts made it."""

    config: EngineConfig  # the config as resolved at start-up: every budget left to cairn sized (sizing.py)
    device: torch.device  # where the model and the pools live
    dtype: torch.dtype  # the weights' (and the KV pool's and state slots')
    cpu_path: str  # the instruction path of cairn's compiled CPU ops (ops/cpu_isa.py); "none" off a CPU
    platform: str  # torch, CPU matrix instructions or GPU: part of the exact-resume namespace (compat.py)
    model: HybridModel
    model_config: ModelConfig
    model_name: str  # the checkpoint directory, or a demo model's name (DEMO_NAME, RANDOM_DEMO_NAME)
    weight_layout: str  # the layout the plain linears were laid out in (model/layout.py)
    tokenizer: Tokenizer
    grammars: GrammarCompiler  # structured output's grammars, for this tokenizer and vocabulary
    sampling_defaults: dict  # generation_config.json's defaults for the fields a request leaves out
    kv: KVPool
    states: StatePool  # the working recurrent-state slots
    cache: PrefixCache  # NullCache for a model without recurrent layers
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int  # the longest prompt + output, in tokens
    prefill_block: int  # the exact-resumption block in tokens (0: off)


def build_parts(config: EngineConfig, cache: PrefixCache | None = None, show_progress: bool = True,
                graph_backend: CaptureBackend | None = None) -> EngineParts:
    """Build everything an Engine runs on (see the module docstring for the order). `cache`: this prefix cache
    instead of the one config.cache describes; `graph_backend`: the decode graph path with this capture backend
    whatever the device (the CPU tests give the checking stand-in, cairn.ops.graph_check); `--cuda-graphs`
    gives CudaGraphBackend on CUDA. ConfigError (one line) for a config this machine or model cannot run."""
    opts = config.model
    device = resolve_device(opts.device)
    if device.type == "cpu":
        # Decayed recurrent states underflow into subnormal floats, which x86 CPUs compute up to
        # 100x slower; flushing them to zero changes no result beyond 1e-38 and is set once here.
        torch.set_flush_denormal(True)
    torch.manual_seed(opts.demo_seed)
    model, model_config, tokenizer, model_name, sampling_defaults = _load_model(opts, device, show_progress)
    grammars = GrammarCompiler(tokenizer, model_config.vocab_size)
    dtype = model.embed.weight.dtype
    quantize(model, model_config, opts.quantization, device)  # before the cache digests it
    cpu_path = _cpu_path(opts.cpu_isa, device, dtype)
    # cairn's compiled CPU ops serve bf16 alone: other dtypes run the references whatever the path
    model.kernels = select_kernels(device, opts.fast_kernels, cpu_path if dtype == torch.bfloat16 else "none")
    config = resolve_sizes(config, device, is_demo=is_demo(opts.model))
    backend = _graph_backend(graph_backend, config, model, model_config, device)
    kv, states = _allocate_pools(config, model_config, dtype, device, reserved_slots=int(backend is not None))
    sched = config.scheduler
    max_num_seqs = min(sched.max_num_seqs, states.num_slots - int(backend is not None))
    graphs = None if backend is None else DecodeGraphs(model, kv, states, backend, max_num_seqs,
                                                       _max_model_len(config, model_config, kv, reserved_pages=1))
    max_model_len = _max_model_len(config, model_config, kv)
    block = prefill_block(sched.prefill_block, dtype, sched.max_num_batched_tokens, max_num_seqs)
    # the weights' digest before the layout re-lays them (an int8 model's too: quantize made them); the
    # kernels the layout chose are part of the cache's compatibility digest (layout.prefill_kernels)
    weights = _weights_digest(model, model_config, config.cache) if cache is None else ""
    platform = kernel_platform(device, cpu_path)  # the exact-resume namespace's, and its start-up line's
    lay_out = apply_layout if opts.quantization == "none" else lay_out_int8
    weight_layout = lay_out(model, opts.weight_layout, dtype, device, cpu_path=cpu_path,
                            path_forced=opts.cpu_isa != "auto")
    if cache is None:
        cache = _build_cache(config.cache, weights, model, model_config, kv, states, block, platform, model_name)
    scheduler = Scheduler(kv.allocator, kv.page_size, states, cache, max_num_seqs, sched.max_num_batched_tokens,
                          max_model_len, sched.max_waiting, block, model.attention_break_even(), GDN_CHUNK)
    runner = ModelRunner(model, kv, states, device, block, graphs)
    _log_prefill_rules(scheduler, block, platform)
    load_fused_cpu_ops(model.kernels, dtype, device)  # built before /health answers, not mid-request
    return EngineParts(config, device, dtype, cpu_path, platform, model, model_config, model_name, weight_layout,
                       tokenizer, grammars, sampling_defaults, kv, states, cache, scheduler, runner, max_model_len,
                       block)


def resolve_device(name: str) -> torch.device:
    """The torch device of `--device` (ModelOptions checked its form); ConfigError for a CUDA device torch
    does not see here, rather than torch's own error from the first tensor put on it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(f"--device {name}: no CUDA device {'here' if count == 0 else 'of that index'} "
                              f"(torch sees {count}; torch {torch.__version__})")
    return device


def prefill_block(requested: int | None, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The exact-resumption block (SchedulerOptions.prefill_block), 0 when off.

    A step must fit a whole block next to a decode token of every other running request, so that no
    block is ever split. Default: 512 (or the largest multiple of 64 that fits) in half precision, where
    a rounding difference changes the output visibly; off in float32."""
    room = (max_num_batched_tokens - max_num_seqs) // GDN_CHUNK * GDN_CHUNK
    if requested is None:
        block = min(512, room) if dtype in (torch.bfloat16, torch.float16) else 0
        if dtype != torch.float32 and block < GDN_CHUNK:
            log.warning("max_num_batched_tokens=%d leaves no room for a %d-token prefill block: resumed requests "
                        "will match cold ones only within rounding", max_num_batched_tokens, GDN_CHUNK)
        return max(block, 0)
    if requested and (requested % GDN_CHUNK or requested > room):
        raise ConfigError(f"--prefill-block {requested}: must be a multiple of {GDN_CHUNK} and at most "
                          f"--max-num-batched-tokens minus --max-num-seqs = {max_num_batched_tokens - max_num_seqs}")
    return requested


def _load_model(opts: ModelOptions, device: torch.device, show_progress: bool
                ) -> tuple[HybridModel, ModelConfig, Tokenizer, str, dict]:
    """The model, its config, its tokenizer, its name and generation_config.json's sampling defaults (logged)."""
    if is_random_demo(opts.model):
        dtype = torch.float32 if opts.dtype == "auto" else getattr(torch, opts.dtype)
        model, model_config, tokenizer = build_demo(dtype, device, opts.demo_seed)
        return model, model_config, tokenizer, RANDOM_DEMO_NAME, {}
    path, dtype = opts.model, opts.dtype
    if opts.model == DEMO_NAME:  # shipped in bf16 to stay small (17 MB: no progress bar); served in float32 by default
        path, dtype = str(demo_checkpoint()), "float32" if opts.dtype == "auto" else opts.dtype
    model, model_config = load_checkpoint(path, dtype, device, show_progress and opts.model != DEMO_NAME)
    tokenizer = HFTokenizer(path, model_config.eos_token_ids + generation_eos_ids(path))
    defaults = generation_defaults(path)
    if defaults:
        log.info("sampling defaults from generation_config.json (for fields a request leaves out): %s",
                 ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    return model, model_config, tokenizer, opts.model, defaults


def _cpu_path(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The instruction path of cairn's compiled CPU ops (cairn/ops/cpu_isa.py) for `requested` (--cpu-isa), said
    in one line: none off a CPU. Where the ops cannot be built here (no compiler, no ninja, a failed build: the
    gemv kernel's build tells, and a bf16 model builds it anyway), none too, said in that one line, so that no
    other op tries to build."""
    if device.type != "cpu":
        return "none"
    flags = cpu_isa.cpu_flags()
    path = cpu_isa.choose(requested, flags)
    if path != "none" and dtype == torch.bfloat16:
        built = cpu_gemv.load(flags, isa=None if requested == "auto" else path)
        if isinstance(built, str) and built.startswith("building"):
            log.warning("CPU path: none, the PyTorch reference kernels (%s)", built)
            return "none"
    log.info("%s", cpu_isa.described(path, requested, flags))
    return path


def _weights_digest(model: HybridModel, model_config: ModelConfig, opts: CacheOptions) -> str:
    """The weights' content digest when a disk or remote cache will need it ("" otherwise: it reads them all)."""
    if not model_config.recurrent_layers or not (opts.disk_cache or opts.remote_cache):
        return ""
    return weights_digest(model)


def _build_cache(opts: CacheOptions, weights: str, model: HybridModel, model_config: ModelConfig, kv: KVPool,
                 states: StatePool, block: int, platform: str, model_name: str) -> PrefixCache:
    """The prefix cache, handed plain values: the compatibility digest is computed here, with a disk or
    remote cache (`weights`: the weights' digest, taken before the layout re-laid them)."""
    if not model_config.recurrent_layers:
        return NullCache()
    digest = compat_digest(weights, model_config, kv.k.dtype, kv.page_size, block, prefill_kernels(model),
                           platform) if weights else ""
    return build_cache(opts, kv, states, model_config.vocab_size, digest, model_name, block)


def _graph_backend(given: CaptureBackend | None, config: EngineConfig, model: HybridModel,
                   model_config: ModelConfig, device: torch.device) -> CaptureBackend | None:
    """The decode graph path's capture backend (None: off), after the refusals (ConfigError, one line); with
    it on, the model runs the graph-safe kernel set (cuda_graphs.graph_kernels)."""
    if given is None and not config.model.cuda_graphs:
        return None
    reason = ((cuda_graphs.device_refusal(device) if given is None else None)  # a given backend: any device
              or cuda_graphs.refusal(model.kernels, model_config.ffn_types))
    if reason:
        raise ConfigError(reason)
    backend = given or cuda_graphs.CudaGraphBackend()
    model.kernels = cuda_graphs.graph_kernels(model.kernels)
    log.info("decode steps replay graphs (%s), captured per batch bucket on first use", backend.name)
    return backend


def _allocate_pools(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                    reserved_slots: int = 0) -> tuple[KVPool, StatePool]:
    mem = config.memory
    n_attn = len(cfg.attention_layers)
    page_bytes = KVPool.page_bytes(max(n_attn, 1), mem.page_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    num_pages = mem.kv_cache_bytes // page_bytes
    if num_pages < 1:
        raise ConfigError(f"--kv-cache-gib {mem.kv_cache_gib} holds no KV page of {page_bytes} bytes")
    spec = cfg.state_spec(dtype)
    slot_bytes = spec.slot_bytes
    wanted = config.scheduler.max_num_seqs + reserved_slots  # reserved: the graph path's scratch slot
    num_slots = min(wanted, mem.state_cache_bytes // max(slot_bytes, 1))
    if num_slots < 1 + reserved_slots:
        raise ConfigError(f"--state-cache-gib {mem.state_cache_gib} holds no state slot of {slot_bytes} bytes")
    kv = KVPool(max(n_attn, 1), num_pages, mem.page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    states = StatePool(spec, num_slots, device)
    log.info("KV pool: %d pages of %d tokens (%.1f MiB); %d working state slots of %.2f MiB",
             num_pages, mem.page_size, kv.total_bytes / 2**20, num_slots, slot_bytes / 2**20)
    return kv, states


def _max_model_len(config: EngineConfig, model_config: ModelConfig, kv: KVPool, reserved_pages: int = 0) -> int:
    """The longest prompt + output: --max-model-len, at most what the model and the KV pool (less the
    pages reserved, or `reserved_pages` a caller is about to reserve) hold. The engine's own call (without
    `reserved_pages`) warns, once, when that cuts the asked length."""
    usable = kv.num_pages - max(reserved_pages, len(kv.allocator.reserved))
    model_len, pool_len = model_config.max_position_embeddings, usable * kv.page_size
    limit = min(model_len, pool_len)
    asked = config.scheduler.max_model_len
    if asked and asked > limit and not reserved_pages:
        why = (f"the model's max_position_embeddings is {model_len}" if model_len <= pool_len else
               f"the KV pool holds no more ({usable} pages of {kv.page_size} tokens); raise --kv-cache-gib "
               "for a longer context")
        log.warning("--max-model-len %d cut to %d tokens: %s", asked, limit, why)
    return min(asked, limit) if asked else limit


def _log_prefill_rules(scheduler: Scheduler, block: int, platform: str) -> None:
    """The start-up lines on how prefill shares a step with decoding streams and resumes exactly."""
    if scheduler.attention_break_even:
        log.info("prefill beside decoding streams: a token at position p takes 1 + p / %d of the step's token "
                 "budget (from that position its attention costs more than its weights)",
                 scheduler.attention_break_even)
    if block:
        log.info("exact resumption: prefill in blocks of %d tokens, resumed at their ends; stored states are "
                 "shared only with the same platform (%s)", block, platform)
