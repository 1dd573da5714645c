"""TieredRadixTree: the radix tree with each node's KV and snapshot copies held per tier, and the victim queues.

What it is: the bookkeeping of where every node's KV lives (Node.kv: tier name -> page ids or a
segment reference) and the victim choices of each tier (DESIGN §4.2-4.4), the one eviction that
runs: `KVVictims` (KV least recently used first, per tier) and `SnapshotVictims` (by the retention key the
tree's builder hands it, policy/retention.py's, among snapshots holding a copy on a tier), each ranked once per
eviction call in a heap instead of a scan of the tree per victim. A node keeps its KV on at least one tier; one
that loses its last copy leaves the tree with its whole subtree (their KV prefix is gone).

What it is not: it copies no bytes and allocates nothing but page references; TierSet moves the
data and then records the move here. Snapshot handles stay opaque (the cache's TieredSnapshot).
Torch-free, single-threaded.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cairn.cache.tree.nodes import (
    DEVICE,
    RELEASE_EVICTED,
    RELEASE_KV_EVICTED,
    DiskRef,
    Node,
    SnapshotEntry,
    common_prefix_len,
    page_indices,
)
from cairn.cache.tree.radix import RadixTree


class KVVictims:
    """The KV victims of one tier for one eviction call, from a heap ranked once (DESIGN §4.2).

    A candidate is an unlocked node holding KV on `tier` that no child holds KV on `tier` below:
    least recently used first, then deeper end, then lower node_id. Within one call recency and
    locks do not change, so a key never goes stale; a popped entry that stopped being a candidate
    (dropped meanwhile, or a child gained a copy) is skipped. A node that becomes a candidate during
    the call (its last child on the tier left, or it just gained a copy) must be `push`ed.
    """

    def __init__(self, tree: TieredRadixTree, tier: str):
        self.tree, self.tier = tree, tier
        self._heap = [self._key(node) for node in tree.iter_nodes() if self._candidate(node)]
        heapq.heapify(self._heap)

    def _candidate(self, node: Node) -> bool:
        return (node.parent is not None and not node.lock_count and self.tree.holds(node, self.tier)
                and not any(self.tree.holds(child, self.tier) for child in node.children.values()))

    @staticmethod
    def _key(node: Node) -> tuple[int, int, int, Node]:
        return node.last_access, -node.end, node.node_id, node

    def push(self, node: Node | None) -> None:
        if node is not None and self._candidate(node):
            heapq.heappush(self._heap, self._key(node))

    def pop(self) -> Node | None:
        """The next victim, or None when no candidate is left."""
        while self._heap:
            node = heapq.heappop(self._heap)[-1]
            if self._candidate(node):
                return node
        return None


class SnapshotVictims:
    """The snapshot victims among those `eligible` for one eviction call, by the tree's retention key.

    Recency is the key's first field and no eviction changes it, so the candidates wait in a heap of
    last_access alone; only the least recent group (one operation's stamp: one chain of snapshots)
    gets full keys. Evicting a snapshot only raises its neighbours' keys, so a group entry whose key
    rose meanwhile goes back with its current key, and one whose key is unchanged is the minimum.
    """

    def __init__(self, tree: TieredRadixTree, eligible: Callable[[SnapshotEntry], bool]):
        self.eligible, self.retention_key = eligible, tree.retention_key
        self._recency = [(node.snapshot.last_access, node.node_id, node) for node in tree.iter_nodes()
                         if self._candidate(node, node.snapshot)]
        heapq.heapify(self._recency)
        self._group: list = []  # (RetentionKey, node_id, node, entry) of the least recent tick

    def _candidate(self, node: Node, entry: SnapshotEntry | None) -> bool:
        return entry is not None and node.snapshot is entry and not entry.lock_count and self.eligible(entry)

    def pop(self) -> Node | None:
        """The node whose snapshot goes next, or None when no unlocked eligible one is left."""
        while self._group or self._recency:
            if not self._group:
                self._next_group()
                continue
            key, node_id, node, entry = self._group[0]
            # within one call only the popped snapshot's own demotion changes which snapshots are on this tier (a
            # slower tier making room evicts snapshots with no copy here: no snapshot is on two page tiers)
            assert self._candidate(node, entry), "a grouped snapshot stopped being a candidate mid-call"
            current = self.retention_key(node)
            if current == key:
                heapq.heappop(self._group)
                return node
            heapq.heapreplace(self._group, (current, node_id, node, entry))
        return None

    def _next_group(self) -> None:
        tick = self._recency[0][0]
        while self._recency and self._recency[0][0] == tick:
            _, node_id, node = heapq.heappop(self._recency)
            if self._candidate(node, node.snapshot):
                self._group.append((self.retention_key(node), node_id, node, node.snapshot))
        heapq.heapify(self._group)


class TieredRadixTree(RadixTree):
    def __init__(self, page_size: int, allocators: dict, on_snapshot_released: Callable[[SnapshotEntry, str], None],
                 retention_key: Callable[[Node], Any]):
        """`retention_key(node)`: the sort key of node's unlocked snapshot, the smallest leaving first (the cache
        hands it policy/retention.py's). SnapshotVictims relies on two of its properties: its first field is the
        snapshot's last_access, and evicting a snapshot never lowers another's key."""
        super().__init__(page_size, allocators, on_snapshot_released)
        self.retention_key = retention_key

    @staticmethod
    def holds(node: Node, tier: str) -> bool:
        """node keeps a copy of its KV on `tier`."""
        return tier in node.kv

    # ---- recording moves ------------------------------------------------------------------------

    def adopt_pages(self, node: Node, tier: str, pages: list[int]) -> None:
        """Record that node's KV is (also) in these freshly allocated pages of page tier `tier`; the tree takes
        over the allocation's reference on each (the caller keeps none)."""
        assert tier not in node.kv and len(pages) == len(page_indices(node.start, node.end, self.page_size))
        self._refs[tier].update(pages)
        node.kv[tier] = list(pages)

    def share_pages(self, node: Node, tier: str, pages: list[int]) -> None:
        """Record that node's KV is (also) in these pages of page tier `tier`, which a request holds too (the
        pages a resume loaded node's KV into): the tree takes a reference of its own on each."""
        assert tier not in node.kv and len(pages) == len(page_indices(node.start, node.end, self.page_size))
        self._incref(tier, pages)
        node.kv[tier] = list(pages)

    @contextmanager
    def moving(self, node: Node) -> Iterator[None]:
        """Keep node and its ancestors out of every victim queue while node's KV is moved to a slower tier:
        making room there must not drop the path being moved (an ancestor losing its last copy takes node out
        of the tree mid-move). A lock on each for the move's length, with no handle: over when the move is."""
        path = list(self._ancestors(node))
        for held in path:
            held.lock_count += 1
        try:
            yield
        finally:
            for held in path:
                held.lock_count -= 1

    def drop_kv(self, node: Node, tier: str) -> int:
        """Forget node's KV copy on `tier` (must be unlocked); returns the device pages freed. A node left with
        no copy leaves the tree with its subtree, their snapshots released as "kv_evicted"."""
        assert node.lock_count == 0, "dropping the KV of a locked node"
        copy = node.kv.pop(tier)
        freed = self._decref(tier, copy) if tier in self.allocators else 0
        if tier != DEVICE:
            freed = 0
        return freed + (self.remove_subtree(node) if not node.kv else 0)

    def remove_subtree(self, node: Node) -> int:
        """Take node and everything below it out of the tree (none may be locked); returns device pages freed."""
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        return sum(self._remove_leaf(n) for n in reversed(order))

    def remove_snapshot(self, node: Node, reason: str = RELEASE_EVICTED) -> SnapshotEntry:
        """Release node's unlocked snapshot (the last copy is gone): tombstone, totals, callback."""
        entry = node.snapshot
        node.snapshot_evicted = True
        self._release_snapshot(node, reason)
        return entry

    def put_snapshot(self, node: Node, entry: SnapshotEntry) -> None:
        """Hang `entry` on an existing node below the root that holds no snapshot (a snapshot found in a segment
        tier: the segment index checks that the node holds none, and a segment's node is never the root)."""
        assert node.snapshot is None and node.end > 0, "put_snapshot on a root or over a snapshot"
        self.clock += 1
        entry.last_access = self.clock
        node.snapshot, node.snapshot_evicted = entry, False
        self._num_snapshots += 1
        self._snapshot_bytes += entry.nbytes

    def mark_budget_miss(self, tokens: Sequence[int], page_table: list[int], salt_key: bytes | None = None) -> None:
        """Insert tokens (under salt_key's root) and record that the snapshot due at their end was not taken for
        lack of budget (match reports "budget" for it until a snapshot is attached there)."""
        node = self.insert(tokens, page_table, salt_key)
        if node.end > 0 and node.snapshot is None:
            node.budget_miss = True

    # ---- restart --------------------------------------------------------------------------------

    def insert_from_segment(self, tier: str, tokens: Sequence[int], start: int, ref: DiskRef,
                            salt_key: bytes | None = None) -> Node:
        """Make tokens a path (under salt_key's root) whose part [start, len(tokens)) lives in segment `ref` of
        segment tier `tier`; [0, start) must already be a path. Nodes created here hold only that copy. Returns
        the node ending at len(tokens)."""
        node = self.root_of(salt_key, create=True)
        self.clock += 1
        while node.end < len(tokens):
            child = node.children.get(tokens[node.end])
            if child is None:
                assert node.end >= start, f"the index hangs parents first: no path before position {node.end}"
                child = Node(self._next_node_id, tuple(tokens[node.end:]), node.end, len(tokens), node, {tier: ref})
                self._next_node_id += 1
                node.children[child.tokens[0]] = child
                self._num_nodes += 1
            else:
                k = common_prefix_len(child.tokens, tokens, node.end)
                if k < len(child.tokens):
                    child = self._split(child, child.start + k)
                if tier not in child.kv and child.start >= start:
                    child.kv[tier] = ref
            child.last_access = self.clock
            node = child
        return node


__all__ = ["KVVictims", "SnapshotVictims", "TieredRadixTree", "RELEASE_KV_EVICTED"]
