"""Sequence: one request as the scheduler sees it.

Token ranges of a sequence at any moment:

    0            num_cached      num_computed                 num_tokens
    |-- resumed ---|-- computed here --|-- still to compute --|
                   (prefill chunks and decode steps)

`num_cached` tokens came from the prefix cache (KV pages shared, recurrent state restored into the
working slot); `num_computed` tokens have KV in `page_table` and are folded into the working slot's
state. `token_ids` is the prompt followed by the generated tokens. In prefill, a step computes up to
the token budget or the end of the tokens; once every token is computed the logits of the last one
give the next token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from cairn.cache.base import Admission, CacheReport
from cairn.request.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    group_id: str  # the request this sequence is one choice of (its own request_id for choice 0)
    num_prompt_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    message_starts: list[int] = field(default_factory=list)  # token position of each chat message start
    user_message_starts: list[int] = field(default_factory=list)  # the subset starting a user message
    breakpoints: dict[int, int] = field(default_factory=dict)  # the client's cache breakpoints: position -> TTL (s)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached: int = 0
    page_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    finish_reason: str | None = None
    cache: CacheReport = field(default_factory=CacheReport)  # what the prefix cache did for it
    generator: torch.Generator | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    last_token_s: float | None = None
    admission: Admission | None = None  # what the prefix cache answered when it was admitted (None: not running)
    ready_logits: torch.Tensor | None = None  # next-token logits restored from the cache (nothing to compute)
    index: int = 0  # its choice index in that request (n > 1)
    grammar: object | None = None  # cairn.request.grammar.Grammar when the output is constrained (structured output)
    penalty: object | None = None  # cairn.request.logits.PenaltyCounts, once its penalties were first applied

    def __post_init__(self):
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:  # choice i of an n > 1 request draws with seed + i, as in vLLM
            seed = self.params.seed if self.index == 0 else (self.params.seed + self.index) % 2**64
            self.generator = torch.Generator().manual_seed(seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        """More than the last token is left to compute."""
        return self.num_tokens - self.num_computed > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def next_chunk_len(self, budget: int) -> int:
        """Tokens to compute this step: up to `budget`, at most to the end of the tokens."""
        return max(0, min(self.num_tokens - self.num_computed, budget))
