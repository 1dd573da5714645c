"""Logits processors: what changes a row's logits before the sampler chooses from them.

Applied by `sample` to the rows that carry a RowContext, in this order (vLLM's semantics):

    repetition_penalty  tokens seen in the prompt or the output: a positive logit is divided by it,
                        a negative one multiplied (> 1 discourages repeats)
    frequency_penalty   minus penalty x (times the token occurs in the output)
    presence_penalty    minus penalty for each token occurring in the output at least once
    logit_bias          added to the listed tokens' logits
    banned              -inf (end-of-sequence and stop tokens before min_tokens)
    allowed             -inf outside the grammar's mask (structured output)

Penalties and bias are computed for all the processed rows at once (token counts by scatter-add
over padded token tensors). Rows without a context are neither copied nor touched. A +inf made by
a penalty is clamped to the largest float, so a row never holds inf - inf.

What this is not: it does not choose tokens (`cairn.sampling`) or build grammar masks (`cairn.grammar`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cairn.sampling import SamplingParams


@dataclass
class RowContext:
    """What the processors need about one row's request at this step."""

    token_ids: list[int]  # the prompt followed by the tokens generated so far
    num_prompt_tokens: int
    banned: tuple[int, ...] = ()  # tokens that may not be chosen at this step
    allowed: torch.Tensor | None = None  # bool [vocab]: the grammar's mask (None: unconstrained)


def _counts(rows: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(rows), vocab] occurrence counts of each row's token ids (ids >= vocab are ignored)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), max(width, 1)), vocab, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long).clamp_(0, vocab)
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _penalize(x: torch.Tensor, params: list[SamplingParams], contexts: list[RowContext]) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that use them."""
    vocab = x.shape[-1]
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        seen = _counts([contexts[i].token_ids for i in rep], vocab) > 0
        penalty = torch.tensor([params[i].repetition_penalty for i in rep]).unsqueeze(-1)
        rows = x[rep]
        x[rep] = torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty), rows)
    additive = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if additive:
        counts = _counts([contexts[i].token_ids[contexts[i].num_prompt_tokens:] for i in additive], vocab)
        freq = torch.tensor([params[i].frequency_penalty for i in additive]).unsqueeze(-1)
        presence = torch.tensor([params[i].presence_penalty for i in additive]).unsqueeze(-1)
        x[additive] -= freq * counts + presence * (counts > 0)


def process_rows(logits: torch.Tensor, params: list[SamplingParams],
                 contexts: list[RowContext | None]) -> dict[int, torch.Tensor]:
    """{row: its processed logits [vocab]} for every row that has a context. `logits` is not modified
    and the rows without a context are not copied."""
    rows = [i for i, c in enumerate(contexts) if c is not None]
    if not rows:
        return {}
    x = logits[rows]  # a copy
    sub_params = [params[i] for i in rows]
    sub_ctx = [contexts[i] for i in rows]
    _penalize(x, sub_params, sub_ctx)
    vocab = x.shape[-1]
    for j, p in enumerate(sub_params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
            bias = torch.tensor([b for t, b in p.logit_bias if 0 <= t < vocab], dtype=x.dtype)
            x[j].index_add_(0, ids, bias)
    torch.nan_to_num_(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    for j, c in enumerate(sub_ctx):
        banned = [t for t in c.banned if 0 <= t < vocab]
        if banned:
            x[j, banned] = float("-inf")
        if c.allowed is not None:
            x[j].masked_fill_(~c.allowed[:vocab], float("-inf"))
    return {i: x[j] for j, i in enumerate(rows)}
