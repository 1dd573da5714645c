"""The radix tree's boundary types: snapshot entries, nodes, match results and lock handles.

What it is: the dataclasses that the tree hands to the planner, the scheduler and the storage tiers,
each field stating its meaning and unit, plus the page-index rule every node follows.

What it is not: no behaviour beyond checking a node (`Node.check_integrity`).
The tree (radix.py) is the only writer of these fields, except the first four of `SnapshotEntry`,
which the creator of a snapshot fills in, and its `pinned_until`, which the cache's pins keep. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SNAPSHOT_SOURCES = ("grid", "message", "breakpoint", "prompt_end", "request_end", "branch", "disk", "remote")
# "disk": found in the disk store (start-up, rescans); "remote": found in the Redis tier by a lookup at admission
MISS_REASONS = ("no_snapshot", "evicted", "budget", "needs_logits")  # the tree's; admission adds "corrupt" (a
# segment failed verification), "evicted" for a segment whose value its store no longer had, and "unavailable"
# for one whose store did not answer (Redis down)
DEVICE, HOST, DISK, REMOTE = "device", "host", "disk", "remote"  # tier names: the one place they are spelled (the
# factory names the tiers with them; DEVICE is the tier whose pages a request's page table lists)
RELEASE_EVICTED = "evicted"  # on_snapshot_released reason: its last copy lost to retention (TierSet demotion)
RELEASE_KV_EVICTED = "kv_evicted"  # on_snapshot_released reason: its node lost its last KV copy


@dataclass(eq=False)
class SnapshotEntry:
    """One snapshot of every recurrent layer's state at its node's end. The tree sets lock_count and last_access."""

    nbytes: int  # bytes the stored state (and logits, if any) occupies in its tier; > 0
    source: str  # placement rule that created it: one of SNAPSHOT_SOURCES
    has_logits: bool  # it also stores the logits at position end - 1, so a prompt ending at end needs no compute
    handle: object = None  # owned by a storage tier (slot id, buffer, file key); the tree never reads it
    lock_count: int = 0  # outstanding LockHandles resuming from it; > 0: never evicted
    last_access: int = 0  # clock tick of the last lock/insert/attach whose path contained its position
    pinned_until: float = 0.0  # time.monotonic() until which a client's cache breakpoint keeps it ahead of unmarked
    #   snapshots (policy/pins.py; set by the cache); 0: not pinned


@dataclass(frozen=True)
class DiskRef:
    """A node's copy in a segment tier (disk): a segment covering [segment_start, segment_end) ⊇ [start, end)."""

    key: bytes  # the segment's content address in the store
    segment_start: int  # first position the segment holds
    segment_end: int  # one past its last position


@dataclass(eq=False)
class Node:
    """A run of tokens [start, end) shared by every path through it. A root is the empty run [0, 0)."""

    node_id: int  # creation order, unique per tree; the last KV-eviction tie-break
    tokens: tuple[int, ...]  # the token ids at positions [start, end); len == end - start
    start: int  # position of tokens[0]; == parent.end
    end: int  # one past the last position; > start except for the root
    parent: Node | None  # None for the root and for a node removed from the tree
    # tier name -> this node's copy of its KV there: a page tier's page ids for page indices
    # start // page_size .. (end - 1) // page_size (list[int]); a segment tier's DiskRef. Never empty
    # below the root: a node that loses its last copy leaves the tree.
    kv: dict[str, list[int] | DiskRef] = field(default_factory=dict)
    children: dict[int, Node] = field(default_factory=dict)  # keyed by child.tokens[0]
    snapshot: SnapshotEntry | None = None  # the snapshot at position end, if any
    snapshot_evicted: bool = False  # a snapshot at end was evicted and none attached since (miss tombstone)
    budget_miss: bool = False  # a snapshot due at end was not taken: its tier was full of locked snapshots
    lock_count: int = 0  # outstanding LockHandles whose locked path passes through this node (and a KV move in
    # progress below it or at it, TieredRadixTree.moving); > 0: KV kept
    last_access: int = 0  # clock tick of the last lock/insert/attach whose path entered this node
    salt_key: bytes | None = None  # a salted namespace's root (RadixTree.roots): its key; None on every other node

    @property
    def pages(self) -> list[int] | None:
        """The device page ids (what a request's page table shares), or None when the KV is not on the device."""
        return self.kv.get(DEVICE)

    def check_integrity(self, page_size: int) -> None:
        """Raise AssertionError unless this (non-root) node agrees with its parent and its own fields."""
        parent, where = self.parent, f"node {self.node_id} [{self.start}, {self.end})"
        if parent is None or not self.tokens or parent.children.get(self.tokens[0]) is not self:
            raise AssertionError(f"{where} is not its parent's child under its first token")
        if self.start != parent.end or self.end - self.start != len(self.tokens):
            raise AssertionError(f"{where}: parent ends at {parent.end}, {len(self.tokens)} tokens")
        spanned = len(page_indices(self.start, self.end, page_size))
        if not self.kv:
            raise AssertionError(f"{where} holds its KV on no tier")
        for tier, copy in self.kv.items():
            if isinstance(copy, DiskRef):
                if not copy.segment_start <= self.start < self.end <= copy.segment_end:
                    raise AssertionError(f"{where} is not inside its {tier} segment {copy}")
            elif len(copy) != spanned:
                raise AssertionError(f"{where} lists {len(copy)} {tier} pages for {spanned} page indices")
        if self.lock_count < 0 or (self.snapshot is not None and self.snapshot.lock_count < 0):
            raise AssertionError(f"{where}: negative lock count")
        if self.snapshot is not None and self.snapshot_evicted:
            raise AssertionError(f"{where}: holds a snapshot and an eviction tombstone")


@dataclass(frozen=True)
class MatchResult:
    """What the tree holds for one prompt (a pure reading; stale after any mutation of the tree).

    0        resume_position   match_len        num_tokens
    |-- KV + snapshot --|-- KV only --|-- not cached --|
    """

    num_tokens: int  # len(tokens) of the query
    match_len: int  # longest common prefix of the query with any path in the tree, tokens
    path: list[Node]  # nodes walked, root excluded; the last one may be matched only partly
    resume_position: int  # deepest usable snapshot position (0: resume nowhere, prefill from scratch)
    resume_node: Node | None  # the node whose end == resume_position and holds that snapshot
    miss_reason: str | None  # one of MISS_REASONS when resume_position < match_len, else None


@dataclass(eq=False)
class LockHandle:
    """Proof of one lock(); pass it to unlock() exactly once."""

    node: Node | None  # deepest locked node; the lock covers it and every ancestor (None: empty path)
    snapshot: SnapshotEntry | None  # the resume snapshot locked with it, if any
    match_len: int  # tokens of the query that had KV when locked


def page_indices(start: int, end: int, page_size: int) -> range:
    """Page indices a node [start, end) lists (empty for the root [0, 0): (0 - 1) // page_size + 1 is 0)."""
    return range(start // page_size, (end - 1) // page_size + 1)


def common_prefix_len(run: tuple[int, ...], tokens: Sequence[int], offset: int) -> int:
    """How many leading tokens of `run` equal tokens[offset:]. A whole run that matches (every node of a match
    but the last) is found by one slice comparison, so a walk over a long path costs no Python loop per token."""
    limit = min(len(run), len(tokens) - offset)
    if limit == len(run) and tuple(tokens[offset:offset + limit]) == run:
        return limit
    k = 0
    while k < limit and run[k] == tokens[offset + k]:
        k += 1
    return k
