"""Stateful test: random operations on the cache's radix tree, checked against an independent reference model.

What this is: a hypothesis `RuleBasedStateMachine` over tokens 0..3, paths of up to 24 tokens and
page_size 4, on a real prefix cache in miniature (tests/tiny_tiers.py: the production TierSet over
tiny CPU pools, a device snapshot tier of 6 slots) and simulated requests that hold page tables.
Eviction goes through the path the server runs: snapshots are stored with `TierSet.store_snapshot`,
which drops retention victims when the tier is full, and KV through `HybridPrefixCache.evict_pages`.
What it is not: a test of the engine, or of exact page ids (tests/test_radix.py asserts those).

The reference model knows nothing of nodes. It keeps
    stored      a set of token tuples: KV for a prefix S is present iff S is a prefix of one of them;
    snaps       {prefix: ModelSnap}: the snapshot at position len(prefix), with its recency;
    tombstones  prefixes whose snapshot was evicted (and KV kept) with none attached since;
    ops         (tick, tokens) of every lock / insert / attach, the clock advancing by one each;
    locks       outstanding locks: (handle, locked prefix = prompt[:match_len], resume prefix or None).
From these it predicts match_len (longest common prefix with any stored tuple), resume_position
(deepest snapshot prefix of the prompt that is usable by DESIGN invariant 1), miss_reason (the
deepest snapshot or tombstone between them), snapshot recency (an op stamps every snapshot prefix
of its tokens) and the retention victim (the minimum of (last_access, deepest, gap / nbytes,
position), with gaps and `deepest` computed from the set of snapshot prefixes alone).

KV eviction depends on node recency, which is a property of the tree's node boundaries, so the model
cannot predict it alone. The `evict_pages` rule therefore checks it in three independent ways:
  1. the order: from a read-only copy of the tree's nodes taken just before the call (parent,
     [start, end), last_access, lock_count, pages) and the allocator's refcounts, a separate
     greedy simulation of the documented rule (unlocked leaves by ascending last_access, deeper end
     first, node_id last; an emptied unlocked parent joins; stop once enough pages are free)
     must give exactly the removed node ids, the pages freed, and the order of "kv_evicted" releases;
  2. safety: every prefix an outstanding lock holds is still fully matched afterwards, and a
     node's recency is never below the last op that reached into it (invariant `node_recency`);
  3. the model update: every removed node [start, end) truncates the stored tuples through its
     first token to `start`; snapshots and tombstones whose prefix lost its KV are dropped, and the
     dropped snapshots must be exactly the ones released with "kv_evicted". The invariants then
     compare the tree's leaves, snapshots and tombstones with the updated model.
After every step: the cache's check_integrity() (tier bytes too), and allocator refcounts ==
tree page_refs() + request pages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.tiny_tiers import VOCAB, TinyCache


def path_tokens(node) -> tuple[int, ...]:
    """The token ids at positions [0, node.end): the tokens of every node from the root down."""
    runs = []
    while node is not None:
        runs.append(node.tokens)
        node = node.parent
    return tuple(token for run in reversed(runs) for token in run)

PAGE_SIZE = 4
MAX_LEN = 24
NUM_PAGES = 512
DEVICE_SLOTS = 6
TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=MAX_LEN)


@dataclass
class ModelSnap:
    has_logits: bool
    nbytes: int
    last_access: int  # tick of the last op whose tokens had this prefix


@dataclass
class ModelLock:
    handle: object  # the tree's LockHandle
    locked: tuple[int, ...]  # prompt[:match_len]
    resume: tuple[int, ...] | None  # prefix of the locked snapshot


@dataclass(frozen=True)
class NodeView:
    """A read-only copy of one tree node, taken before evict_pages."""

    node_id: int
    parent_id: int
    start: int
    end: int
    last_access: int
    lock_count: int
    pages: tuple[int, ...]
    path: tuple[int, ...]
    snapshot_handle: object


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def is_prefix(prefix, tokens) -> bool:
    return len(prefix) <= len(tokens) and tuple(tokens[: len(prefix)]) == prefix


def predict_kv_eviction(views: dict[int, NodeView], refcount: list[int], num_pages: int):
    """The documented greedy rule, re-implemented over a flat copy: (removed ids in order, pages freed)."""
    num_children = Counter(view.parent_id for view in views.values())
    candidates = [v for v in views.values() if num_children[v.node_id] == 0 and v.lock_count == 0]
    removed, num_freed = [], 0
    while num_freed < num_pages and candidates:
        victim = min(candidates, key=lambda v: (v.last_access, -v.end, v.node_id))
        candidates.remove(victim)
        removed.append(victim.node_id)
        for page in victim.pages:
            refcount[page] -= 1
            num_freed += refcount[page] == 0
        num_children[victim.parent_id] -= 1
        parent = views.get(victim.parent_id)
        if parent is not None and num_children[parent.node_id] == 0 and parent.lock_count == 0:
            candidates.append(parent)
    return removed, num_freed


class RadixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = TinyCache(PAGE_SIZE, NUM_PAGES, device_slots=DEVICE_SLOTS)
        self.alloc, self.tree, self.released = self.cache.alloc, self.cache.tree, self.cache.released
        self.stored: set[tuple[int, ...]] = set()
        self.snaps: dict[tuple[int, ...], ModelSnap] = {}
        self.tombstones: set[tuple[int, ...]] = set()
        self.ops: list[tuple[int, tuple[int, ...]]] = []
        self.clock = 0
        self.locks: list[ModelLock] = []
        self.held: list[list[int]] = []  # page tables of simulated requests still running

    # ---- model --------------------------------------------------------------------------------

    def kv_present(self, prefix) -> bool:
        return any(is_prefix(prefix, stored) for stored in self.stored)

    def stamp(self, tokens) -> None:
        """One lock / insert / attach over `tokens`: advance the clock, stamp the snapshots it contains."""
        self.clock += 1
        self.ops.append((self.clock, tuple(tokens)))
        for prefix, snap in self.snaps.items():
            if is_prefix(prefix, tokens):
                snap.last_access = self.clock

    def predict_match(self, prompt, need_logits: bool) -> tuple[int, int, str | None]:
        match_len = max((lcp(prompt, stored) for stored in self.stored), default=0)
        usable = [
            len(prefix)
            for prefix, snap in self.snaps.items()
            if is_prefix(prefix, prompt[:match_len])
            and (len(prefix) < len(prompt) or snap.has_logits or not need_logits)
        ]
        resume = max(usable, default=0)
        if resume == match_len:
            return match_len, resume, None
        for position in range(match_len, resume, -1):
            if prompt[:position] in self.snaps:
                return match_len, resume, "needs_logits"
            if prompt[:position] in self.tombstones:
                return match_len, resume, "evicted"
        return match_len, resume, "no_snapshot"

    def predict_victim(self) -> tuple[int, ...] | None:
        locked = {lock.resume for lock in self.locks}

        def key(prefix):
            above = [len(other) for other in self.snaps if len(other) < len(prefix) and is_prefix(other, prefix)]
            deepest = not any(len(other) > len(prefix) and is_prefix(prefix, other) for other in self.snaps)
            gap = len(prefix) - max(above, default=0)
            snap = self.snaps[prefix]
            return snap.last_access, deepest, Fraction(gap, snap.nbytes), len(prefix)

        candidates = [prefix for prefix in self.snaps if prefix not in locked]
        return min(candidates, key=key) if candidates else None

    # ---- simulated requests -------------------------------------------------------------------

    def draw_prompt(self, data, allow_empty: bool = True) -> tuple[int, ...]:
        """Random tokens, or (3 times in 4) a stored path or snapshot prefix, often cut, then random tokens.

        Reusing known paths is what makes prompts share prefixes, stamp whole chains of snapshots
        with one tick (so retention ties on recency and gaps decide) and resume from snapshots.
        """
        tokens = data.draw(TOKENS)
        known = sorted(self.stored | set(self.snaps))
        if known and data.draw(st.integers(0, 3)) > 0:
            base = data.draw(st.sampled_from(known))
            cut = len(base) if data.draw(st.booleans()) else data.draw(st.integers(0, len(base)))
            tokens = list(base[:cut]) + tokens[: data.draw(st.integers(0, 8))]
        tokens = tuple(tokens[:MAX_LEN])
        return tokens if tokens or allow_empty else (0,)

    def request_table(self, tokens) -> list[int] | None:
        """A request's page table: the tree's pages for the whole pages it matched (shared), fresh ones after."""
        result = self.tree.match(tokens)
        sources = self.tree.prefix_page_sources(result, result.match_len // PAGE_SIZE * PAGE_SIZE)
        shared = [node.pages[i] for node, i in sources]
        num_fresh = -(-len(tokens) // PAGE_SIZE) - len(shared)
        if num_fresh > self.alloc.num_free:
            return None
        self.alloc.incref(shared)
        return shared + self.alloc.alloc(num_fresh)

    # ---- rules --------------------------------------------------------------------------------

    @rule(data=st.data(), keep=st.booleans())
    def insert(self, data, keep):
        tokens = self.draw_prompt(data)
        table = self.request_table(tokens)
        if table is None:
            return
        node = self.tree.insert(tokens, table)
        self.stamp(tokens)
        if tokens:
            self.stored.add(tokens)
        assert node.end == len(tokens) and path_tokens(node) == tokens
        if keep:
            self.held.append(table)
        else:
            self.alloc.decref(table)

    @rule(data=st.data())
    def attach(self, data):
        """One request's prefill taking snapshots at up to 6 cuts along its prompt, shallowest first."""
        tokens = self.draw_prompt(data, allow_empty=False)
        table = self.request_table(tokens)
        if table is None:
            return
        cuts = data.draw(st.lists(st.integers(1, len(tokens)), min_size=1, max_size=6, unique=True))
        for cut in sorted(cuts):
            prefix, has_logits = tokens[:cut], data.draw(st.booleans())
            nbytes = self.cache.slot_bytes + (4 * VOCAB if has_logits else 0)
            stored = self.evict_for(nbytes, DEVICE_SLOTS * self.cache.slot_bytes,
                                    lambda p=prefix, h=has_logits: self.cache.store(p, h))
            if stored is None:  # every snapshot left on the device is locked: the request goes without
                continue
            attached = self.tree.attach_snapshot(prefix, table, stored)
            self.stored.add(prefix)
            self.stamp(prefix)
            assert attached == (prefix not in self.snaps)
            if attached:
                self.snaps[prefix] = ModelSnap(has_logits, nbytes, self.clock)
                self.tombstones.discard(prefix)
            else:
                self.cache.tiers.release(stored.handle)
        self.alloc.decref(table)

    def evict_for(self, nbytes: int, budget: int, store):
        """Call store() (which makes room for nbytes in the device tier); check the victims it dropped
        against the model's retention order, and update the model. Returns what store() returned."""
        predicted, used = [], sum(snap.nbytes for snap in self.snaps.values())
        while len(self.snaps) >= DEVICE_SLOTS or used + nbytes > budget:
            victim = self.predict_victim()
            if victim is None:
                break
            predicted.append(victim)
            used -= self.snaps.pop(victim).nbytes
            self.tombstones.add(victim)
        num_released = len(self.released)
        result = store()
        assert self.released[num_released:] == [(victim, "evicted") for victim in predicted]
        return result

    @rule(data=st.data(), need_logits=st.booleans())
    def match(self, data, need_logits):
        prompt = self.draw_prompt(data)
        result = self.tree.match(prompt, need_logits)
        predicted = self.predict_match(prompt, need_logits)
        assert (result.match_len, result.resume_position, result.miss_reason) == predicted
        if result.resume_node is not None:
            assert self.cache.label(result.resume_node.snapshot) == prompt[: result.resume_position]

    @rule(data=st.data(), need_logits=st.booleans())
    def lock(self, data, need_logits):
        prompt = self.draw_prompt(data)
        result = self.tree.match(prompt, need_logits)
        handle = self.tree.lock(result)
        locked = prompt[: result.match_len]
        self.stamp(locked)
        resume = prompt[: result.resume_position] if result.resume_node is not None else None
        self.locks.append(ModelLock(handle, locked, resume))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        lock = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(lock.handle)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish_request(self, data):
        self.alloc.decref(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))

    @rule(has_logits=st.booleans())
    def make_room(self, has_logits):
        """The device tier shrunk to what it holds, then one more snapshot stored: one call, several victims."""
        used = sum(snap.nbytes for snap in self.snaps.values())
        nbytes = self.cache.slot_bytes + (4 * VOCAB if has_logits else 0)
        self.evict_for(nbytes, used, lambda: self.cache.make_room(has_logits))

    @rule(num_pages=st.integers(0, 8))
    def evict_pages(self, num_pages):
        views = {node.node_id: self.view(node) for node in self.tree.iter_nodes()}
        predicted_removed, predicted_freed = predict_kv_eviction(views, list(self.alloc.refcount), num_pages)
        num_released = len(self.released)
        num_freed = self.cache.cache.evict_pages(num_pages)  # the scheduler's call
        removed = sorted(set(views) - {node.node_id for node in self.tree.iter_nodes()})
        assert (removed, num_freed) == (sorted(predicted_removed), predicted_freed)
        kv_released = [handle for handle, reason in self.released[num_released:] if reason == "kv_evicted"]
        assert kv_released == [views[i].snapshot_handle for i in predicted_removed if views[i].snapshot_handle]
        self.apply_kv_eviction([views[i] for i in predicted_removed], kv_released)

    def view(self, node) -> NodeView:
        handle = self.cache.label(node.snapshot) if node.snapshot is not None else None
        return NodeView(
            node.node_id,
            node.parent.node_id,
            node.start,
            node.end,
            node.last_access,
            node.lock_count,
            tuple(node.pages),
            path_tokens(node),
            handle,
        )

    def apply_kv_eviction(self, removed: list[NodeView], kv_released: list) -> None:
        for view in removed:
            through = view.path[: view.start + 1]
            self.stored = {s[: view.start] if is_prefix(through, s) else s for s in self.stored} - {()}
        lost = {prefix for prefix in self.snaps if not self.kv_present(prefix)}
        assert lost == set(kv_released)
        for prefix in lost:
            del self.snaps[prefix]
        self.tombstones = {prefix for prefix in self.tombstones if self.kv_present(prefix)}
        for lock in self.locks:
            assert self.tree.match(lock.locked).match_len == len(lock.locked)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def integrity(self):
        self.cache.check(held=[page for table in self.held for page in table])

    @invariant()
    def leaves_are_the_maximal_stored_paths(self):
        leaves = {path_tokens(node) for node in self.tree.iter_nodes() if not node.children}
        maximal = {s for s in self.stored if not any(len(t) > len(s) and is_prefix(s, t) for t in self.stored)}
        assert leaves == maximal

    @invariant()
    def snapshots_equal_the_model(self):
        tree_snaps = {path_tokens(node): entry for _, entry, node in self.tree.iter_snapshots()}
        assert set(tree_snaps) == set(self.snaps)
        resumed = Counter(lock.resume for lock in self.locks)
        for prefix, entry in tree_snaps.items():
            model = self.snaps[prefix]
            assert self.cache.label(entry) == prefix
            assert (entry.has_logits, entry.nbytes, entry.last_access) == (
                model.has_logits,
                model.nbytes,
                model.last_access,
            )
            assert entry.lock_count == resumed[prefix]
        assert self.tree.num_snapshots == len(self.snaps)
        assert self.tree.snapshot_bytes == sum(snap.nbytes for snap in self.snaps.values())
        tombstones = {path_tokens(node) for node in self.tree.iter_nodes() if node.snapshot_evicted}
        assert tombstones == self.tombstones

    @invariant()
    def node_recency(self):
        """A node's last_access is at least the tick of the last op whose tokens reached into it."""
        for node in self.tree.iter_nodes():
            path = path_tokens(node)
            reached = [tick for tick, tokens in self.ops if lcp(tokens, path) > node.start]
            assert node.last_access >= max(reached, default=0)
        assert self.tree.clock == self.clock


TestRadixTree = RadixMachine.TestCase
TestRadixTree.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
