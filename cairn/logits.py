"""Logits processors: what changes a row's logits before the sampler chooses from them.

Applied by `sample` to the rows that carry a RowContext, in this order (vLLM's semantics):

    repetition_penalty  tokens seen in the prompt or the output: a positive logit is divided by it,
                        a negative one multiplied (> 1 discourages repeats)
    frequency_penalty   minus penalty x (times the token occurs in the output)
    presence_penalty    minus penalty for each token occurring in the output at least once
    logit_bias          added to the listed tokens' logits
    banned              -inf (end-of-sequence and stop tokens before min_tokens)
    allowed             -inf outside the grammar's mask (structured output)

Penalties and bias touch only the token ids concerned (the distinct ids of the prompt and output,
the biased ids), row by row: cheaper than dense [rows, vocab] count tensors at a 150k vocabulary.
Rows without a context are neither copied nor touched. A +inf made by
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


def _penalize(row: torch.Tensor, p: SamplingParams, ctx: RowContext) -> None:
    """Repetition, frequency and presence penalties on one row, in place. Only the ids that occur are
    touched (a few hundred, not the whole vocabulary)."""
    vocab = row.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(ctx.token_ids, dtype=torch.long).unique()
        seen = seen[(seen >= 0) & (seen < vocab)]
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        output = torch.tensor(ctx.token_ids[ctx.num_prompt_tokens:], dtype=torch.long)
        ids, counts = output[(output >= 0) & (output < vocab)].unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


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
    vocab = x.shape[-1]
    for j, p in enumerate(sub_params):
        _penalize(x[j], p, sub_ctx[j])
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
