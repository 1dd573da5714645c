"""Engine configuration: frozen, typed dataclasses that the command line is generated from.

Every field carries its help text in `metadata["help"]`; `cairn.cli` turns each field into a flag
(`kv_cache_gib` -> `--kv-cache-gib`). Nothing below the CLI parses arguments or reads the
environment: these objects are built once and passed down. Derived values are properties.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelOptions:
    model: str | None = _f(None, "Hugging Face checkpoint directory; omit it for the built-in demo model")
    dtype: str = _f("auto", "weights and activations: auto (the checkpoint's), bfloat16, float16 or float32",
                    choices=("auto", "bfloat16", "float16", "float32"))
    device: str = _f("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    demo_seed: int = _f(0, "seed of the demo model's random weights")
    quantization: str = _f("none", "weight-only quantization of the linear layers (CPU, dense models): none or "
                           "int8 (one scale per output channel; half the bytes a bf16 decode step reads)",
                           choices=("none", "int8"))
    weight_layout: str = _f("auto", "layout of the linear weights: auto (packed for bf16/fp16 on a CPU with "
                            "oneDNN support, else plain; logged at start-up), plain, or packed (oneDNN's "
                            "blocked layout for AMX / AVX512-BF16)", choices=("auto", "plain", "packed"))
    fast_kernels: bool = _f(False, "on CUDA, use flash-linear-attention's gated delta rule where installed "
                            "(untested on GPU so far; the reference kernels otherwise)")


@dataclass(frozen=True)
class MemoryOptions:
    page_size: int = _f(16, "tokens per KV page")
    kv_cache_gib: float = _f(1.0, "device bytes for the paged KV pool of the attention layers, in GiB")
    state_cache_gib: float = _f(0.25, "device bytes for the working recurrent-state slots, in GiB")

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
    max_waiting: int = _f(1024, "most requests queued before new ones are refused")


@dataclass(frozen=True)
class CacheOptions:
    prefix_cache: bool = _f(True, "keep KV and state snapshots of past requests and resume new ones from them")
    snapshot_interval: int = _f(1024, "a snapshot every this many tokens of absolute position; 0 turns the grid off")
    snapshot_at_messages: bool = _f(True, "a snapshot where every chat message starts")
    snapshot_at_prompt_end: bool = _f(True, "a snapshot (with its logits) at the end of every prompt")
    snapshot_at_request_end: bool = _f(True, "a snapshot at the end of every request, after generation")
    snapshot_at_branch: bool = _f(True, "a snapshot where a prompt leaves a cached path below its deepest snapshot")
    device_snapshot_gib: float = _f(1.0, "device bytes for snapshots, in GiB")
    snapshot_policy: str = _f("cairn", "where snapshots go: cairn, or a baseline for comparison (none, last_chunk, "
                              "prompt_end_branch, user_messages)",
                              choices=("cairn", "none", "last_chunk", "prompt_end_branch", "user_messages"))
    snapshot_min_gap: int = _f(0, "least distance between snapshots of the user_messages policy, in tokens")
    host_cache_gib: float = _f(0.0, "host RAM for demoted snapshots and KV pages, in GiB; 0: no host tier")
    disk_cache: str | None = _f(None, "directory of the durable disk tier (survives restarts); none by default")
    disk_cache_gib: float = _f(16.0, "disk bytes for the disk tier, in GiB")
    disk_write_through: bool = _f(True, "write each finished request's new snapshots and KV to disk at once "
                                  "(durable across restarts); otherwise only what the host tier evicts")
    disk_compression: str = _f("none", "compression of disk segments: none, zstd or lz4",
                               choices=("none", "zstd", "lz4"))

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
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
