"""The cache policies the benchmark compares, as engine configurations over the same weights and budgets.

Every policy gets a fresh engine built from one EngineConfig (same checkpoint, same KV pool and
snapshot budgets, same chunk size); only these cache fields differ:

    none               prefix_cache=False: every prompt is prefilled whole
    last_chunk         snapshot_policy="last_chunk": one snapshot at the last 64-aligned position of the
                       prompt's final prefill chunk, and the request end only when it falls on a page
                       boundary (FreeToken / SGLang-style hybrid radix cache, seeds/000)
    prompt_end_branch  snapshot_policy="prompt_end_branch": the prompt end and branch points only
    user_messages      snapshot_policy="user_messages", snapshot_min_gap=N: llama.cpp-style checkpoints
                       at user-message starts at least N tokens apart, plus the prompt end
    cairn              snapshot_policy="cairn": grid, message starts, prompt end, request end, branches

What `user_messages` models of llama.cpp's server (tools/server: --ctx-checkpoints,
--checkpoint-min-step): checkpoints are exact-position copies of the recurrent state, taken while a
prompt is processed, at user-message starts spaced by a minimum step, plus one at the prompt end.
What it leaves out, each of which costs llama.cpp reuse that this baseline keeps:
- per-slot ownership: a slot that another conversation reuses erases that slot's checkpoints past
  the common prefix (seeds/001);
- the per-slot cap on checkpoints (--ctx-checkpoints, 32 in recent builds), with the oldest evicted;
- the RAM prompt cache's f_keep / f_sim lookup;
- builds whose end-of-prompt checkpoint sits a few tokens before the end;
- the last-user-message exception to the minimum step, which spends the cap on closely spaced
  checkpoints (llama.cpp PR 25019).
Here the baseline's snapshots live in cairn's shared radix tree under cairn's byte budget and
value-based retention. llama.cpp's default minimum step is 8192 tokens, on contexts of 100k+. The
benchmark's contexts are a few thousand tokens, so its default spacing (`--snapshot-min-gap`) is
scaled down to 1024 (256 in the smoke run, `cairn bench`'s default).

What it is not: the policies' implementation (cairn/cache/policy/placement.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cairn.config import ConfigError, EngineConfig

POLICIES = ("none", "last_chunk", "prompt_end_branch", "user_messages", "cairn")
LABELS = {"none": "no cache", "last_chunk": "last chunk", "prompt_end_branch": "prompt end + branch",
          "user_messages": "llama.cpp-style", "cairn": "cairn"}
SMOKE_MIN_GAP_TOKENS = 256  # the llama.cpp-style spacing of the smoke run (the published 0.8B run passes 1024)


def policy_config(base: EngineConfig, policy: str, disk_dir: Path | None = None) -> EngineConfig:
    """`base` with the cache fields of `policy`; `disk_dir` puts the disk tier there. base's
    snapshot_min_gap is the user_messages policy's spacing: the other policies run without one."""
    assert policy in POLICIES, policy  # its one caller passes names parse_names checked against POLICIES
    if policy == "none":
        return dataclasses.replace(base, cache=dataclasses.replace(base.cache, prefix_cache=False))
    fields = {"prefix_cache": True, "snapshot_policy": policy,
              "snapshot_min_gap": base.cache.snapshot_min_gap if policy == "user_messages" else 0}
    if disk_dir is not None:
        fields["disk_cache"] = str(disk_dir)
    return dataclasses.replace(base, cache=dataclasses.replace(base.cache, **fields))


def parse_names(spec: str, known: tuple[str, ...] | list[str], flag: str) -> list[str]:
    """'all' or a comma-separated subset of `known`, in the order given (ConfigError naming --flag: another)."""
    if spec == "all":
        return list(known)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"--{flag}: unknown {unknown or spec!r}; known: {', '.join(known)} or all")
    return names
