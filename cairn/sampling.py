"""SamplingParams and the sampler.

Order of operations on a row of logits (fp32): temperature, then top-k, top-p and min-p filtering,
then a draw from the request's own generator (seeded per request when `seed` is set). Temperature 0
is greedy. Log-probabilities reported for the chosen token (and the top alternatives) are those of
the model's unmodified distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256  # most tokens to generate
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one
    seed: int | None = None  # per-request seed: the same seed and prompt give the same tokens
    stop: tuple[str, ...] = ()  # stop strings; the output ends before the first occurrence
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens, beside the model's end-of-sequence tokens
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    logprobs: bool = False  # report the chosen token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives
    cache_prompt: bool = True  # read and write the prefix cache for this request
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # free-form per-request tags

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
             "stop must be at most 16 non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each token
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = before >= p.top_p
        probs = probs.masked_fill(drop, 0.0)
    return probs


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[Sampled]:
    """One token per row of `logits` [N, vocab] (fp32)."""
    greedy_tokens = logits.argmax(dim=-1).tolist()
    want_logprobs = any(p.logprobs or p.top_logprobs for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    out = []
    for i, p in enumerate(params):
        if p.greedy:
            token = greedy_tokens[i]
        else:
            probs = _filter(logits[i], p)
            token = int(torch.multinomial(probs, 1, generator=generators[i]).item())
        s = Sampled(token)
        if logprobs is not None and (p.logprobs or p.top_logprobs):
            s.logprob = float(logprobs[i, token])
            if p.top_logprobs:
                values, ids = torch.topk(logprobs[i], p.top_logprobs)
                s.top_logprobs = list(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(s)
    return out
