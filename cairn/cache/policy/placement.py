"""Snapshot placement (DESIGN §4.1): the positions of a prompt where a snapshot is taken, and why.

A pure function of the request and what the cache already holds. Positions are absolute token
positions p (a snapshot at p is the state after tokens [0, p)); only positions past the resume point
are returned, since the cache already holds what lies below it.

    0        resume        match                         prompt_len
    |----------|-------------|--------------------------------|
               grid: every `interval` tokens of absolute position (k * interval)
               message: where each chat message starts
               branch: `match`, when the prompt leaves a cached path that has a snapshot deeper than it
               breakpoint: where the client marked a block to cache (Anthropic's cache_control), in (resume, prompt_len]
               prompt_end: prompt_len (stored with the logits of its last token)

The end of the request after generation is placed by the cache when the request finishes
(`request_end_allowed`).

With `align` (exact resumption, the engine's prefill block) every position moves down to a multiple
of `align` and no request end is taken, so the tree holds KV and snapshots only of whole blocks computed
by prefill: a resumed request restarts on a block boundary up to which a cold run computes the same
blocks, never inside a block, after a prompt's last partial block (computed as a shorter product) or
after tokens computed by decode steps. The prompt end keeps its logits only when it is a multiple.

`policy` selects cairn's placement ("cairn", above) or one of the baselines other engines use, so that
a benchmark can compare policies on the same weights and budgets:

    "none"               no snapshots (with the cache on, only exact prompt-end reuse is impossible too)
    "last_chunk"         one snapshot at the last 64-aligned position of the prompt's final prefill chunk,
                         and the request end only when it falls on a page boundary
    "prompt_end_branch"  the prompt end and branch points only
    "user_messages"      every user-message start, at least `min_gap_tokens` apart, plus the prompt end
"""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCES = ("grid", "message", "breakpoint", "branch", "prompt_end", "request_end")
POLICIES = ("cairn", "none", "last_chunk", "prompt_end_branch", "user_messages")
LAST_CHUNK_ALIGN = 64


@dataclass(frozen=True)
class PlacementOptions:
    interval_tokens: int = 1024  # grid spacing in absolute positions; 0 turns the grid off
    at_messages: bool = True  # a snapshot where every chat message starts
    at_prompt_end: bool = True  # a snapshot (with logits) at the end of every prompt
    at_request_end: bool = True  # a snapshot at the end of every request, after generation
    at_branch: bool = True  # a snapshot where a prompt leaves a cached path below its deepest snapshot
    min_gap_tokens: int = 0  # skip a grid point (a message start for "user_messages") closer than this
    policy: str = "cairn"  # one of POLICIES
    page_size: int = 16  # KV page size, for the "last_chunk" baseline's request-end rule
    align: int = 0  # exact resumption: snapshots only at multiples of this (and prompt ends); 0: anywhere

    def __post_init__(self):
        if self.policy not in POLICIES:  # refused when the cache is built, not at every request's admission
            raise ValueError(f"unknown snapshot placement policy {self.policy!r}; known: {', '.join(POLICIES)}")


@dataclass(frozen=True)
class PlacementInput:
    prompt_len: int  # tokens in the prompt
    resume_position: int  # where the request resumes (0: cold)
    match_length: int  # longest common prefix with a cached path
    path_has_deeper_snapshot: bool  # the matched cached path holds a snapshot beyond match_length
    message_starts: tuple[int, ...] = field(default=())  # token position of each chat message start
    user_message_starts: tuple[int, ...] = field(default=())  # the subset that starts a user message
    breakpoints: tuple[int, ...] = field(default=())  # where the client's cache breakpoints are (cairn's policy only)


def place(inp: PlacementInput, opts: PlacementOptions) -> dict[int, str]:
    """{position: source} for every snapshot to take while prefilling this prompt."""
    chosen = _place(inp, opts) if opts.policy == "cairn" else _place_baseline(inp, opts)
    return _aligned(chosen, inp, opts.align) if opts.align else chosen


def _aligned(chosen: dict[int, str], inp: PlacementInput, align: int) -> dict[int, str]:
    """Each position moved down to a multiple of `align` (the first source to land there names it)."""
    out: dict[int, str] = {}
    # as `place` names a shared position
    priority = ("prompt_end", "branch", "breakpoint", "message", "grid", "request_end")
    for p, source in sorted(chosen.items(), key=lambda item: priority.index(item[1])):
        q = p // align * align
        if inp.resume_position < q:
            out.setdefault(q, source)
    return dict(sorted(out.items()))


def _place(inp: PlacementInput, opts: PlacementOptions) -> dict[int, str]:
    lo, hi = inp.resume_position, inp.prompt_len
    chosen: dict[int, str] = {}
    if opts.at_prompt_end and hi > lo:
        chosen[hi] = "prompt_end"
    if opts.at_branch and inp.path_has_deeper_snapshot and lo < inp.match_length < hi:
        chosen.setdefault(inp.match_length, "branch")
    for p in inp.breakpoints:  # the client asked for these (a prompt end there keeps its name and logits)
        if lo < p <= hi:
            chosen.setdefault(p, "breakpoint")
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


def placed_breakpoints(chosen: dict[int, str], inp: PlacementInput, opts: PlacementOptions) -> set[int]:
    """The positions of `chosen` (what `place` returned) that stand for a client's breakpoint: each breakpoint past
    the resume point, moved down to a multiple of `align` as `place` moved it, whatever source names it there (a
    prompt end, a branch point)."""
    if opts.policy != "cairn":
        return set()
    aligned = (breakpoint_position(p, opts) for p in inp.breakpoints)
    return {p for p in aligned if inp.resume_position < p <= inp.prompt_len and p in chosen}


def breakpoint_position(position: int, opts: PlacementOptions) -> int:
    """Where the snapshot standing for a client's breakpoint at `position` goes: moved down to a multiple of
    `align` (the prefill blocks exact resumption computes in), as `place` moves it."""
    return position // opts.align * opts.align if opts.align else position


def request_end_allowed(position: int, opts: PlacementOptions) -> bool:
    """Whether a finished request leaves a snapshot at its end (`position`)."""
    if opts.align:
        return False  # its last tokens were computed by decode steps, not as a cold prefill computes them
    if opts.policy in ("none", "prompt_end_branch", "user_messages"):
        return False
    if opts.policy == "last_chunk":
        return position % opts.page_size == 0
    return opts.at_request_end


def _place_baseline(inp: PlacementInput, opts: PlacementOptions) -> dict[int, str]:
    lo, hi = inp.resume_position, inp.prompt_len
    chosen: dict[int, str] = {}
    if opts.policy == "last_chunk":
        aligned = (hi - 1) // LAST_CHUNK_ALIGN * LAST_CHUNK_ALIGN
        if lo < aligned:
            chosen[aligned] = "prompt_end"
    elif opts.policy == "prompt_end_branch":
        if hi > lo:
            chosen[hi] = "prompt_end"
        if inp.path_has_deeper_snapshot and lo < inp.match_length < hi:
            chosen[inp.match_length] = "branch"
    elif opts.policy == "user_messages":
        last = lo
        for p in inp.user_message_starts:
            if lo < p < hi and p - last >= opts.min_gap_tokens:
                chosen[p] = "message"
                last = p
        if hi > lo:
            chosen[hi] = "prompt_end"
    return dict(sorted(chosen.items()))  # "none": no snapshots
