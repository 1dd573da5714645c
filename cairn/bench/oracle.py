"""The unlimited-cache oracle: how many prompt tokens a cache with no budget could have reused.

For request i of a stream, with prompt P_i and full sequence S_j = P_j + generated_j of every earlier
request j < i:

    oracle_i = len(P_i)                                    if P_j == P_i for some j < i
             = min(max_j lcp(P_i, S_j), len(P_i) - 1)      otherwise

where lcp is the longest common prefix in tokens (at least one prompt token must be computed for
the next-token logits, unless the identical prompt was served before and its logits were kept).
The reuse of a run is sum(cached_tokens) / sum(oracle). The oracle ignores budgets, eviction and
restarts, and it does not ask whether a recurrent state could exist at the divergence point: an
engine that snapshots only some positions reaches it only when a snapshot sits exactly there.

It is computed from the token ids the engine actually saw (the runner records them), so engine and
HTTP runs of the same stream agree. Pure; numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.size else n


def oracle_tokens(prompts: Sequence[Sequence[int]], full_sequences: Sequence[Sequence[int]]) -> list[int]:
    """oracle_i for every request of a stream, in order (see the module docstring)."""
    seen: set[tuple[int, ...]] = set()
    earlier: list[np.ndarray] = []
    out = []
    for prompt, full in zip(prompts, full_sequences, strict=True):
        key = tuple(prompt)
        if key in seen:
            out.append(len(prompt))
        else:
            p = np.asarray(prompt, dtype=np.int64)
            best = max((common_prefix_len(p, s) for s in earlier), default=0)
            out.append(min(best, max(len(prompt) - 1, 0)))
        seen.add(key)
        earlier.append(np.asarray(full, dtype=np.int64))
    return out
