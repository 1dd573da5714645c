"""The batched sampler, and the sampling defaults a checkpoint gives (SamplingParams: sampling_params.py).

Order of operations on the logits of one step [N, vocab] (fp32):

1. logits processors, only on the rows that ask for them (`cairn.request.logits`): repetition, frequency
   and presence penalties, logit_bias, the tokens banned this step (end-of-sequence before
   `min_tokens`) and the grammar mask of structured output. Other rows are not touched or copied;
2. greedy rows (temperature below GREEDY_TEMPERATURE) take the argmax;
3. the other rows, as one batch: temperature, then top-k, min-p and top-p filtering, then a draw,
   from the request's own generator when it has a seed.

Numerically safe for every value SamplingParams accepts: a temperature under 1e-5 is greedy (as
vLLM does), logits are shifted by their row maximum before the temperature divides them, top-p and
min-p always keep the most likely token, and infinities made by penalties are clamped. A row that
still cannot be sampled (every token masked, or non-finite logits from the model) fails alone: its
Sampled carries `error` and the other rows are sampled as usual.

Log-probabilities reported for the chosen token (and the top alternatives) are those of the
model's unmodified distribution.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from cairn.errors import SamplingError
from cairn.request.logits import RowContext, process_rows
from cairn.request.sampling_params import SamplingParams

log = logging.getLogger("cairn.sampling")  # the name of its log lines, not the module path

# generation_config.json keys that give a default for a request field the client left out
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # this row could not be sampled (token is then meaningless)


def generation_defaults(checkpoint: str | Path) -> dict[str, float | int]:
    """The sampling defaults of a checkpoint's generation_config.json (GENERATION_DEFAULT_KEYS found
    there, in range), used for the fields a request leaves out. {} when there is no such file."""
    path = Path(checkpoint) / "generation_config.json"
    try:
        raw = _generation_config(path)
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s): no sampling defaults from it", path, e)
        return {}
    found = {k: raw[k] for k in GENERATION_DEFAULT_KEYS if isinstance(raw.get(k), int | float)}
    try:
        SamplingParams(**found)
    except SamplingError as e:
        log.warning("%s: %s; its sampling defaults are ignored", path, e)
        return {}
    return found


def generation_eos_ids(checkpoint: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids of a checkpoint's generation_config.json (`eos_token_id`, an int or a list): what
    transformers' generate and vLLM stop on besides config.json's, often an end-of-turn token config.json
    leaves out. () when there is no such file or it is unreadable (generation_defaults logs that)."""
    try:
        eos = _generation_config(Path(checkpoint) / "generation_config.json").get("eos_token_id")
    except (OSError, ValueError):
        return ()
    return tuple(e for e in (eos if isinstance(eos, list) else [eos]) if type(e) is int)


def _generation_config(path: Path) -> dict:
    """A generation_config.json's object ({} when absent); OSError or ValueError when it cannot be read as one."""
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    return raw


# ---- the sampler --------------------------------------------------------------------------------

def _filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities [k, vocab] after temperature, top-k, min-p and top-p, and which rows are usable."""
    vocab = logits.shape[-1]
    x = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))
    row_max = x.max(dim=-1, keepdim=True).values
    ok = torch.isfinite(row_max).squeeze(-1)
    temps = torch.tensor([p.temperature for p in params], dtype=x.dtype).unsqueeze(-1)
    x = (x - torch.where(torch.isfinite(row_max), row_max, 0.0)) / temps  # <= 0, the maximum is exactly 0
    if not any(0 < p.top_k < vocab or p.min_p > 0 or p.top_p < 1 for p in params):
        return torch.softmax(x, dim=-1), ok
    ranked, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(vocab)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).unsqueeze(-1)
    ranked = ranked.masked_fill(rank >= top_k, float("-inf"))
    probs = torch.softmax(ranked, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype).unsqueeze(-1)
    if bool((min_p > 0).any()):
        probs = torch.softmax(ranked.masked_fill(probs < min_p * probs[:, :1], float("-inf")), dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype).unsqueeze(-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each token
    drop = (before >= top_p) & (rank > 0) & (top_p < 1.0)  # the most likely token always stays
    probs = probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, probs), ok


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row; rows without a generator share one multinomial call."""
    tokens = [0] * len(generators)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        drawn = torch.multinomial(probs[shared], 1).squeeze(-1).tolist()
        for i, t in zip(shared, drawn, strict=True):
            tokens[i] = t
    for i, g in enumerate(generators):
        if g is not None:
            tokens[i] = int(torch.multinomial(probs[i], 1, generator=g).item())
    return tokens


def _rows(logits: torch.Tensor, ids: list[int], processed: dict[int, torch.Tensor]) -> torch.Tensor:
    """logits[ids] with the processed rows in place of the raw ones (a copy unless it is all of `logits`)."""
    if len(ids) == logits.shape[0] and not any(i in processed for i in ids):
        return logits
    out = logits[ids]
    for k, i in enumerate(ids):
        if i in processed:
            out[k] = processed[i]
    return out


def _choose(logits: torch.Tensor, processed: dict[int, torch.Tensor], params: list[SamplingParams],
            generators: list[torch.Generator | None]) -> tuple[list[int], list[str | None]]:
    """The token of every row (greedy or drawn) and, per row, why it could not be sampled."""
    n = len(params)
    tokens: list[int] = [0] * n
    errors: list[str | None] = [None] * n
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        raw = logits if len(greedy) == n else logits[greedy]  # the processed rows are taken from `processed`
        best = raw.max(dim=-1)
        values, indices = best.values.tolist(), best.indices.tolist()
        for k, i in enumerate(greedy):
            if i in processed:
                value, token = processed[i].max(dim=-1)
                values[k], indices[k] = float(value), int(token)
            tokens[i] = indices[k]
            if values[k] != values[k] or values[k] == float("-inf"):
                errors[i] = "no token can be sampled: every token is masked or the logits are not finite"
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        probs, ok = _filter_rows(_rows(logits, drawn, processed), [params[i] for i in drawn])
        good = [j for j, usable in enumerate(ok.tolist()) if usable]
        for j, usable in enumerate(ok.tolist()):
            if not usable:
                errors[drawn[j]] = "no token can be sampled: every token is masked or the logits are not finite"
        if good:
            picked = _draw(probs[good], [generators[drawn[j]] for j in good])
            for j, token in zip(good, picked, strict=True):
                tokens[drawn[j]] = token
    return tokens, errors


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    contexts: list[RowContext | None] | None = None,
) -> list[Sampled]:
    """One token per row of `logits` [N, vocab] (fp32). `contexts[i]` (optional) carries what row i's
    processors need (its tokens so far, banned tokens, grammar mask); None rows skip processing."""
    processed = process_rows(logits, params, contexts) if contexts is not None else {}
    tokens, errors = _choose(logits, processed, params, generators)
    want_logprobs = any(p.logprobs or p.top_logprobs for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    out = []
    for i, p in enumerate(params):
        s = Sampled(tokens[i], error=errors[i])
        if logprobs is not None and (p.logprobs or p.top_logprobs) and s.error is None:
            s.logprob = float(logprobs[i, s.token])
            if p.top_logprobs:
                values, ids = torch.topk(logprobs[i], p.top_logprobs)
                s.top_logprobs = list(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(s)
    return out


def sample_isolated(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    contexts: list[RowContext | None] | None = None,
) -> list[Sampled]:
    """`sample`, but an exception raised by one row's parameters fails that row alone: the batch is
    sampled again row by row and the rows that raise come back with `error` set."""
    try:
        return sample(logits, params, generators, contexts)
    except Exception:
        log.exception("sampling the batch failed; sampling its %d rows one by one", len(params))
    out = []
    for i, p in enumerate(params):
        ctx = None if contexts is None else [contexts[i]]
        try:
            out.extend(sample(logits[i:i + 1], [p], [generators[i]], ctx))
        except Exception as e:
            out.append(Sampled(0, error=f"sampling failed: {type(e).__name__}: {e}"))
    return out
