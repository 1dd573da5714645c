"""TieredRadixTree: the radix tree with each node's KV and snapshot placed on device, host and disk tiers.

What it is: the bookkeeping of where every node's KV pages and every snapshot live, and the victim
choices of each tier (DESIGN §4.2-4.4): KV leaves least-recently-used first per tier, snapshots by
retention value among those holding a copy on that tier. A node keeps its KV on at least one tier;
one that loses its last copy leaves the tree with its whole subtree (their KV prefix is gone).

What it is not: it copies no bytes and allocates nothing but page references; the cache moves the
data and then records the move here. Snapshot handles stay opaque (the cache's TieredSnapshot).
Torch-free, single-threaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cairn.cache.policy.retention import rank_snapshots
from cairn.cache.tree.nodes import (
    RELEASE_EVICTED,
    RELEASE_KV_EVICTED,
    DiskRef,
    Node,
    SnapshotEntry,
    common_prefix_len,
    page_indices,
)
from cairn.cache.tree.radix import RadixTree

TIERS = ("device", "host", "disk")


class TieredRadixTree(RadixTree):
    # ---- victims (pure) -------------------------------------------------------------------------

    def kv_victim(self, tier: str) -> Node | None:
        """The unlocked node holding KV on `tier` that no child holds KV on `tier` below, least recently
        used first (then deeper end, then lower node_id). None when there is none."""
        best = None
        for node in self.iter_nodes():
            if node.lock_count or not self._holds(node, tier):
                continue
            if any(self._holds(child, tier) for child in node.children.values()):
                continue
            if best is None or self._leaf_key(node)[:3] < self._leaf_key(best)[:3]:
                best = node
        return best

    def snapshot_victim(self, eligible: Callable[[SnapshotEntry], bool]) -> Node | None:
        """The node whose unlocked, eligible snapshot the retention order gives up first. Pure."""
        ranked = rank_snapshots(self.root, eligible)
        return min(ranked, key=lambda pair: pair[0])[1] if ranked else None

    @staticmethod
    def _holds(node: Node, tier: str) -> bool:
        return {"device": node.pages, "host": node.host_pages, "disk": node.disk}[tier] is not None

    # ---- recording moves ------------------------------------------------------------------------

    def adopt_host_pages(self, node: Node, pages: list[int]) -> None:
        """Record that node's KV is (also) in these freshly allocated host-bank pages; the tree takes over
        the allocation's reference on each (the caller keeps none)."""
        assert node.host_pages is None and len(pages) == len(page_indices(node.start, node.end, self.page_size))
        self._host_refs.update(pages)
        node.host_pages = list(pages)

    def set_disk(self, node: Node, ref: DiskRef) -> None:
        node.disk = ref

    def drop_kv(self, node: Node, tier: str) -> int:
        """Forget node's KV copy on `tier` (must be unlocked); returns that tier's pages freed. A node left
        with no copy leaves the tree with its subtree, their snapshots released as "kv_evicted"."""
        assert node.lock_count == 0, "dropping the KV of a locked node"
        freed = 0
        if tier == "device":
            freed, node.pages = self._decref(node.pages), None
        elif tier == "host":
            freed, node.host_pages = self._host_decref(node.host_pages), None
        else:
            node.disk = None
        if not node.kv_tiers():
            node.pages = []  # a placeholder so the removal below decrefs nothing twice
            freed += self.remove_subtree(node)
        return freed

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

    def put_snapshot(self, node: Node, entry: SnapshotEntry) -> bool:
        """Hang `entry` on an existing node (a snapshot found on disk at start-up); False if one is there."""
        if node.snapshot is not None or node is self.root:
            return False
        self.clock += 1
        entry.last_access = self.clock
        node.snapshot, node.snapshot_evicted = entry, False
        self._num_snapshots += 1
        self._snapshot_bytes += entry.nbytes
        return True

    def mark_budget_miss(self, tokens: Sequence[int], page_table: list[int]) -> None:
        """Insert tokens and record that the snapshot due at their end was not taken for lack of budget
        (match reports "budget" for it until a snapshot is attached there)."""
        node = self.insert(tokens, page_table)
        if node is not self.root and node.snapshot is None:
            node.budget_miss = True

    def nodes_on_disk(self, key: bytes) -> list[Node]:
        """Nodes whose KV is in the disk segment `key` (a segment may back several nodes after splits)."""
        return [node for node in self.iter_nodes() if node.disk is not None and node.disk.key == key]

    # ---- restart --------------------------------------------------------------------------------

    def insert_from_disk(self, tokens: Sequence[int], start: int, ref: DiskRef) -> Node:
        """Make tokens a path whose part [start, len(tokens)) lives in disk segment `ref`; [0, start) must
        already be a path. Nodes created here hold only the disk copy. Returns the node ending at len(tokens)."""
        node = self.root
        self.clock += 1
        while node.end < len(tokens):
            child = node.children.get(tokens[node.end])
            if child is None:
                if node.end < start:
                    raise ValueError(f"insert_from_disk: the path is missing before position {node.end}")
                child = Node(self._next_node_id, tuple(tokens[node.end:]), node.end, len(tokens), node, None)
                child.disk = ref
                self._next_node_id += 1
                node.children[child.tokens[0]] = child
                self._num_nodes += 1
            else:
                k = common_prefix_len(child.tokens, tokens, node.end)
                if k < len(child.tokens):
                    child = self._split(child, child.start + k)
                if child.disk is None and child.start >= start:
                    child.disk = ref
            child.last_access = self.clock
            node = child
        return node


__all__ = ["TIERS", "TieredRadixTree", "RELEASE_KV_EVICTED"]
