"""Logits processors: what changes a row's logits before the sampler chooses from them.

Applied by `sample` to the rows that carry a RowContext, in this order (vLLM's semantics):

    repetition_penalty  tokens seen in the prompt or the output: a positive logit is divided by it,
                        a negative one multiplied (> 1 discourages repeats)
    frequency_penalty   minus penalty x (times the token occurs in the output)
    presence_penalty    minus penalty for each token occurring in the output at least once
    logit_bias          added to the listed tokens' logits
    banned              -inf (end-of-sequence and stop tokens before min_tokens)
    allowed             -inf outside the grammar's mask (structured output)

The penalties read a sequence's `PenaltyCounts`: which ids its prompt and output hold and how often
each occurs in the output, as [vocab] tensors brought up to date with only the tokens appended since
the step before, so that a row's penalties cost the same at its 60,000th token as at its first
(converting the whole prompt and output every step took 9 ms per row at 60k tokens, on the engine
thread, which every other stream waited behind). The bias touches only the biased ids. Rows without
a context are neither copied nor touched. A +inf made by a penalty is clamped to the largest float,
so a row never holds inf - inf.

What this is not: it does not choose tokens (`cairn.request.sampling`) or build grammar masks (`cairn.request.grammar`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cairn.request.sampling_params import SamplingParams


class PenaltyCounts:
    """One sequence's tokens for the penalties, kept from step to step: the distinct ids of its prompt and output
    (`seen_ids`: the repetition penalty), and those of its output with how often each occurs (`output_ids`,
    `output_counts`: frequency and presence), as tensors on the logits' device. `update` reads only the tokens
    appended since its last call: a step's cost grows with the distinct ids, never with the length of the context.
    Used by the engine thread only."""

    def __init__(self):
        self.seen_ids = torch.zeros(0, dtype=torch.long)
        self.output_ids = torch.zeros(0, dtype=torch.long)
        self.output_counts = torch.zeros(0)
        self.upto = 0  # token_ids[:upto] are counted
        self._key: tuple | None = None  # (vocab, device, num_prompt_tokens) they were counted for
        self._seen: set[int] = set()
        self._output_at: dict[int, int] = {}  # output id -> its index in output_ids

    def update(self, token_ids: list[int], num_prompt_tokens: int, vocab: int, device: torch.device) -> None:
        key = (vocab, device, num_prompt_tokens)
        if key != self._key or len(token_ids) < self.upto:  # (never, for a sequence's own: counted afresh)
            self.__init__()
            self._key = key
        if len(token_ids) == self.upto:
            return
        split = max(num_prompt_tokens, self.upto)
        new_seen = [t for t in dict.fromkeys(token_ids[self.upto:]) if 0 <= t < vocab and t not in self._seen]
        if new_seen:
            self._seen.update(new_seen)
            self.seen_ids = torch.cat([self.seen_ids.to(device), torch.tensor(new_seen, device=device)])
        new_output, at = [], []  # the output ids met for the first time; the index of every new output token's id
        for t in token_ids[split:]:
            if 0 <= t < vocab:
                if t not in self._output_at:
                    self._output_at[t] = len(self._output_at)
                    new_output.append(t)
                at.append(self._output_at[t])
        if new_output:
            self.output_ids = torch.cat([self.output_ids.to(device), torch.tensor(new_output, device=device)])
            self.output_counts = torch.cat([self.output_counts.to(device), torch.zeros(len(new_output), device=device)])
        if at:
            self.output_counts.index_add_(0, torch.tensor(at, device=device), torch.ones(len(at), device=device))
        self.upto = len(token_ids)


@dataclass
class RowContext:
    """What the processors need about one row's request at this step."""

    token_ids: list[int]  # the prompt followed by the tokens generated so far
    num_prompt_tokens: int
    banned: tuple[int, ...] = ()  # tokens that may not be chosen at this step
    allowed: torch.Tensor | None = None  # bool [vocab]: the grammar's mask (None: unconstrained)
    penalty: PenaltyCounts | None = None  # the sequence's own, kept from step to step (None: counted afresh)


def _penalize(row: torch.Tensor, p: SamplingParams, ctx: RowContext) -> None:
    """Repetition, frequency and presence penalties on one row, in place. Only the ids that occur are
    touched (a few hundred, not the whole vocabulary)."""
    if p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty:
        return
    counts = ctx.penalty if ctx.penalty is not None else PenaltyCounts()
    counts.update(ctx.token_ids, ctx.num_prompt_tokens, row.shape[-1], row.device)
    if p.repetition_penalty != 1.0:
        seen = counts.seen_ids
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        row[counts.output_ids] -= p.frequency_penalty * counts.output_counts.to(row.dtype) + p.presence_penalty


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
