"""Snapshot placement (DESIGN §4.1): the positions of a prompt where a snapshot is taken, and why.

A pure function of the request and what the cache already holds. Positions are absolute token
positions p (a snapshot at p is the state after tokens [0, p)); only positions past the resume point
are returned, since the cache already holds what lies below it.

    0        resume        match                         prompt_len
    |----------|-------------|--------------------------------|
               grid: every `interval` tokens of absolute position (k * interval)
               message: where each chat message starts
               branch: `match`, when the prompt leaves a cached path that has a snapshot deeper than it
               prompt_end: prompt_len (stored with the logits of its last token)

The end of the request after generation is placed by the cache when the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCES = ("grid", "message", "branch", "prompt_end", "request_end")


@dataclass(frozen=True)
class PlacementOptions:
    interval_tokens: int = 1024  # grid spacing in absolute positions; 0 turns the grid off
    at_messages: bool = True  # a snapshot where every chat message starts
    at_prompt_end: bool = True  # a snapshot (with logits) at the end of every prompt
    at_request_end: bool = True  # a snapshot at the end of every request, after generation
    at_branch: bool = True  # a snapshot where a prompt leaves a cached path below its deepest snapshot
    min_gap_tokens: int = 0  # skip a grid point closer than this to another chosen position


@dataclass(frozen=True)
class PlacementInput:
    prompt_len: int  # tokens in the prompt
    resume_position: int  # where the request resumes (0: cold)
    match_length: int  # longest common prefix with a cached path
    path_has_deeper_snapshot: bool  # the matched cached path holds a snapshot beyond match_length
    message_starts: tuple[int, ...] = field(default=())  # token position of each chat message start


def place(inp: PlacementInput, opts: PlacementOptions) -> dict[int, str]:
    """{position: source} for every snapshot to take while prefilling this prompt."""
    lo, hi = inp.resume_position, inp.prompt_len
    chosen: dict[int, str] = {}
    if opts.at_prompt_end and hi > lo:
        chosen[hi] = "prompt_end"
    if opts.at_branch and inp.path_has_deeper_snapshot and lo < inp.match_length < hi:
        chosen.setdefault(inp.match_length, "branch")
    if opts.at_messages:
        for p in inp.message_starts:
            if lo < p < hi:
                chosen.setdefault(p, "message")
    if opts.interval_tokens > 0:
        first = (lo // opts.interval_tokens + 1) * opts.interval_tokens
        fixed = sorted(chosen)
        for p in range(first, hi, opts.interval_tokens):
            if opts.min_gap_tokens and any(abs(p - q) < opts.min_gap_tokens for q in fixed):
                continue
            chosen.setdefault(p, "grid")
    return dict(sorted(chosen.items()))
