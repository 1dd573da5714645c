"""Engine configuration: frozen, typed dataclasses that the command line is generated from.

Every field carries its help text in `metadata["help"]`; `cairn.cli` turns each field into a flag
(`kv_cache_gib` -> `--kv-cache-gib`). Nothing below the CLI parses arguments or reads the
environment (`environment_defaults` is for the entry points alone: the command line and `LLM`): these
objects are built once and passed down. Derived values are properties. Memory
budgets left at None are the machine's and the model's to decide: the engine resolves them once at
start-up (`cairn.engine.sizing.resolve_sizes`, which logs the result); the `*_bytes` properties are read only
after that.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

GIB = 1 << 30
CPU_ISAS = ("auto", "none", "avx2", "avx512_bf16", "amx_bf16")  # --cpu-isa: auto or a path of cairn/ops/cpu_isa.py


class ConfigError(ValueError):
    """An option's value cairn cannot run with (`--port 70000`, `--max-num-seqs 0`, a KV budget that holds
    no page). The message names the flag; the command line prints it as one line, with no traceback."""


def environment_defaults() -> dict[str, str]:
    """Engine options the environment sets, for the entry points (the command line's defaults, `LLM(...)`'s):
    CAIRN_CPU_ISA -> cpu_isa, the instruction path of the compiled CPU ops, so that a whole process (a test run
    included) can be put on one path."""
    value = os.environ.get("CAIRN_CPU_ISA")
    return {"cpu_isa": value} if value else {}


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def check_at_least(options, least: dict[str, float], positive: tuple[str, ...] = ()) -> None:
    """ConfigError naming the flag of the first field of `options` below its least value in `least`, or (in
    `positive`) not above 0. A field left at None (the machine's or the model's to decide) is not checked."""
    for name, bound in [*((n, (lo, False)) for n, lo in least.items()), *((n, (0, True)) for n in positive)]:
        value, (lo, strict) = getattr(options, name), bound
        if value is not None and (value <= lo if strict else value < lo):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be {'above' if strict else 'at least'} {lo}, got {value}")


DEMO_NAME = "cairn-demo"  # the trained demo model shipped with cairn (cairn.engine.demo)
RANDOM_DEMO_NAME = "cairn-demo-random"  # the demo model's shape with random weights from --demo-seed


def is_random_demo(model: str | None) -> bool:
    """Whether --model `model` is the random demo model (None, the library's default, is)."""
    return model in (None, RANDOM_DEMO_NAME)


@dataclass(frozen=True)
class ModelOptions:
    model: str | None = _f(None, f"Hugging Face checkpoint directory, or a built-in demo model: {DEMO_NAME} (trained, "
                           f"shipped with cairn; the command line's default) or {RANDOM_DEMO_NAME} (random weights; "
                           "the library's default)")
    dtype: str = _f("auto", "weights and activations: auto (the checkpoint's), bfloat16, float16 or float32",
                    choices=("auto", "bfloat16", "float16", "float32"))
    device: str = _f("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    demo_seed: int = _f(0, f"seed of the random demo model's weights ({RANDOM_DEMO_NAME} only)")
    quantization: str = _f("none", "weight-only quantization of the linear layers (CPU, dense models): none or "
                           "int8 (one scale per output channel; half the bytes a bf16 decode step reads)",
                           choices=("none", "int8"))
    weight_layout: str = _f("auto", "layout of the linear weights: auto (gemv for bf16 where the kernel builds on a "
                            "CPU with AMX-BF16 or AVX512-BF16, or with AVX2 + FMA where oneDNN has no bf16 matmul; "
                            "else plain; logged at start-up), plain, packed (oneDNN's blocked layout for AMX / "
                            "AVX512-BF16), or gemv (cairn's bf16 gemv kernel for decode batches of up to 16 rows, "
                            "F.linear above; on AVX2 a prefill too, 16 rows at a time; built on first use)",
                            choices=("auto", "plain", "packed", "gemv"))
    cpu_isa: str = _f("auto", "instruction path of cairn's compiled CPU ops (the gemv kernel and the fused bf16 decode "
                      "ops): auto (the best this CPU has), amx_bf16, avx512_bf16, avx2 (each refused above what the "
                      "CPU has), or none (no compiled op: the PyTorch reference kernels); the CAIRN_CPU_ISA "
                      "environment variable sets it too; logged at start-up",
                      choices=CPU_ISAS)
    fast_kernels: bool = _f(False, "on CUDA, use the field's kernels where installed: flash-linear-attention "
                            "(gated delta rule), causal-conv1d (conv), FlashInfer (paged attention); untested on "
                            "GPU so far; the reference kernels otherwise")
    cuda_graphs: bool = _f(False, "on CUDA, replay each pure decode step as a CUDA graph captured per batch bucket "
                           "(1, 2, 4, ... up to --max-num-seqs; mixed steps and prefill stay eager); refused on a "
                           "CPU, with a fast decode kernel not known to be graph-safe, or with MoE layers; reserves "
                           "one KV page and one state slot for padding rows; untested on GPU so far")

    def __post_init__(self):
        if self.cpu_isa not in CPU_ISAS:
            raise ConfigError(f"--cpu-isa / CAIRN_CPU_ISA {self.cpu_isa!r}: unknown (choose from "
                              f"{', '.join(CPU_ISAS)})")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"--device {self.device}: must be auto, cpu, cuda or cuda:N")
        if not is_random_demo(self.model) and self.demo_seed != 0:
            raise ConfigError(f"--demo-seed seeds the random demo model's weights: drop it, or pass --model "
                              f"{RANDOM_DEMO_NAME}")


@dataclass(frozen=True)
class MemoryOptions:
    page_size: int = _f(16, "tokens per KV page")
    kv_cache_gib: float | None = _f(None, "device bytes for the paged KV pool of the attention layers, in GiB; "
                                    "default: 1 (0.125 for the demo model)")
    state_cache_gib: float | None = _f(None, "device bytes for the working recurrent-state slots, in GiB; default: "
                                       "0.25 (1/64 for the demo model)")
    device_memory_fraction: float | None = _f(None, "fraction of the device's memory this server may use (like "
                                              "vLLM's --gpu-memory-utilization): the KV pool, working states and "
                                              "device snapshots share what the weights leave of it, in the "
                                              "proportions of their GiB budgets; on CPU the device is host RAM")

    def __post_init__(self):
        check_at_least(self, {"page_size": 1}, positive=("kv_cache_gib", "state_cache_gib"))
        if self.device_memory_fraction is not None and not 0 < self.device_memory_fraction <= 1:
            raise ConfigError(f"--device-memory-fraction must be in (0, 1], got {self.device_memory_fraction}")

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * GIB)

    @property
    def state_cache_bytes(self) -> int:
        return int(self.state_cache_gib * GIB)


@dataclass(frozen=True)
class SchedulerOptions:
    max_num_seqs: int = _f(16, "most requests running at once (each takes one working state slot)")
    max_num_batched_tokens: int = _f(2048, "token budget of one step: decode tokens plus prefill chunks")
    max_model_len: int | None = _f(None, "longest prompt + output; default: the model's and the KV pool's limit")
    max_waiting: int = _f(1024, "most requests queued beyond the free running seats before new ones are refused")
    prefill_block: int | None = _f(
        None, "exact resumption: prefill runs in blocks of this many tokens at absolute positions (a multiple of "
        "64) and the prefix cache resumes only at block boundaries or a whole cached prompt, so a resumed request "
        "computes bit for bit what a cold one does; 0: resume at any position (equal to cold within rounding); "
        "default: 512 in bfloat16/float16, 0 in float32")

    def __post_init__(self):
        check_at_least(self, {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 1, "max_waiting": 0,
                              "prefill_block": 0})


@dataclass(frozen=True)
class CacheOptions:
    prefix_cache: bool = _f(True, "keep KV and state snapshots of past requests and resume new ones from them")
    snapshot_interval: int = _f(1024, "a snapshot every this many tokens of absolute position; 0 turns the grid off")
    snapshot_at_messages: bool = _f(True, "a snapshot where every chat message starts")
    snapshot_at_prompt_end: bool = _f(True, "a snapshot (with its logits) at the end of every prompt")
    snapshot_at_request_end: bool = _f(True, "a snapshot at the end of every request, after generation")
    snapshot_at_branch: bool = _f(True, "a snapshot where a prompt leaves a cached path below its deepest snapshot")
    device_snapshot_gib: float | None = _f(None, "device bytes for snapshots, in GiB; default: 1 (1/16 for the demo "
                                           "model)")
    snapshot_policy: str = _f("cairn", "where snapshots go: cairn, or a baseline for comparison (none, last_chunk, "
                              "prompt_end_branch, user_messages)",
                              choices=("cairn", "none", "last_chunk", "prompt_end_branch", "user_messages"))
    breakpoint_pin_share: float = _f(0.5, "share of each page tier's snapshot budget (device, host) that snapshots at "
                                     "clients' cache breakpoints (cache_control) keep ahead of the others for their "
                                     "TTL (5 minutes, or 1 hour when asked); 0: ordinary retention for them too")
    snapshot_min_gap: int = _f(0, "least distance between snapshots, in tokens: of the user_messages policy's "
                                 "message starts, or with cairn, of a grid snapshot from a message-start, prompt-end "
                                 "or branch one (closer grid points are skipped)")
    host_cache_gib: float | None = _f(None, "host RAM for demoted snapshots and KV pages, in GiB; default: min(25% of "
                                      "available RAM, 8 GiB) (0.25 at most for the demo model), logged at start-up; "
                                      "0: no host tier")
    disk_cache: str | None = _f(None, "directory of the durable disk tier (survives restarts); none by default")
    disk_cache_create_parents: bool = _f(False, "create the missing parent directories of --disk-cache too "
                                         "(otherwise only its last component is created)")
    disk_cache_gib: float = _f(16.0, "disk bytes for the disk tier, in GiB")
    disk_write_through: bool = _f(True, "write each finished (or aborted) request's new snapshots and KV to disk at "
                                  "once (durable across restarts); otherwise only what the host tier evicts")
    disk_compression: str = _f("none", "compression of disk segments: none, zstd or lz4",
                               choices=("none", "zstd", "lz4"))
    remote_cache: str | None = field(default=None, repr=False, metadata={  # (it may hold a password: kept out of repr)
        "help": "Redis URL of a remote tier shared by replicas (redis://HOST:PORT/DB, rediss://, "
                "redis+cluster://HOST:PORT or ?cluster=true), the slowest tier, after disk; none by default. A URL "
                "with a password is better given by `cairn serve --remote-cache-file` or CAIRN_REMOTE_CACHE, out of "
                "the process list"})

    def __post_init__(self):
        # a disk budget of 0 would hold nothing, and the lock holder's start-up would delete every segment stored
        # (`cairn cache purge` does that on purpose; no --disk-cache means no disk tier)
        check_at_least(self, {"snapshot_interval": 0, "snapshot_min_gap": 0, "device_snapshot_gib": 0,
                              "host_cache_gib": 0}, positive=("disk_cache_gib",))
        if not 0 <= self.breakpoint_pin_share <= 1:
            raise ConfigError(f"--breakpoint-pin-share must be between 0 and 1, not {self.breakpoint_pin_share}")
        if self.disk_cache is None:  # a disk tier's own flag without the tier would do nothing
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name, flag in (("disk_cache_gib", "--disk-cache-gib"), ("disk_compression", "--disk-compression"),
                               ("disk_cache_create_parents", "--disk-cache-create-parents"),
                               ("disk_write_through", "--no-disk-write-through")):
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(f"{flag} needs --disk-cache (without it there is no disk tier)")
        # the schemes cairn.cache.remote.client.split_url takes, checked here before anything slow (the remote
        # tier parses its URL only when it first connects, on a thread of its own)
        if self.remote_cache is not None and not re.match(r"rediss?(\+cluster)?://", self.remote_cache, re.I):
            raise ConfigError("--remote-cache must be a redis://, rediss:// or redis+cluster:// URL (the value "
                              "given is not shown: it may hold a password)")

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gib * GIB)

    @property
    def disk_cache_bytes(self) -> int:
        return int(self.disk_cache_gib * GIB)

    @property
    def device_snapshot_bytes(self) -> int:
        return int(self.device_snapshot_gib * GIB)


@dataclass(frozen=True)
class LogOptions:
    log_requests: bool = _f(True, "log one INFO line per finished request (tokens, cache hit, time to first token, "
                            "decode speed, finish reason)")
    log_stats_interval_s: float = _f(10.0, "while busy, log a stats line (running, waiting, tok/s, cache hits per "
                                     "tier, pool use) every this many seconds; 0: never")

    def __post_init__(self):
        check_at_least(self, {"log_stats_interval_s": 0})


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    logging: LogOptions = field(default_factory=LogOptions)


def config_with_overrides(base: EngineConfig, **overrides) -> EngineConfig:
    """A copy of `base` with fields of any option group replaced by keyword (unknown keys are errors):
    `config_with_overrides(EngineConfig(), kv_cache_gib=2, page_size=32)`."""
    groups = {}
    remaining = dict(overrides)
    for group in dataclasses.fields(EngineConfig):
        options = getattr(base, group.name)
        names = {f.name for f in dataclasses.fields(options)}
        mine = {k: remaining.pop(k) for k in list(remaining) if k in names}
        groups[group.name] = dataclasses.replace(options, **mine)
    if remaining:
        raise TypeError(f"unknown engine options: {sorted(remaining)}")
    return dataclasses.replace(base, **groups)
