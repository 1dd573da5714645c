"""RadixTree: the token index of the hybrid prefix cache (KV pages per node, one optional snapshot per node).

What it is: the bookkeeping that says, for a prompt, how much of it has attention KV in the tree and
where a recurrent-state snapshot lets it resume (DESIGN §1, invariant 1). Eviction (§4.2) is in
tiered.py (the victim queues) and tiers/tier_set.py (demote before drop), the one path that runs.
It holds page ids (one `PageAllocator` reference per node and listed page)
and opaque snapshot handles.

What it is not: it never touches tensors or imports torch, never copies or frees snapshot memory
(the storage tier does that in `on_snapshot_released`), does not decide where snapshots are taken,
and does not plan across tiers. Not thread-safe; the engine calls it from one thread.

Positions and pages (page_size 4). A node owns tokens [start, end) of every path through it and
lists the pages of page indices start // page_size .. (end - 1) // page_size:

    position   0 1 2 3 | 4 5 6 7 | 8 9
    node A     [------------ )              A = [0, 6): pages of indices 0, 1
    node B                   [-------- )    B = [6, 10): pages of indices 1, 2
                                            index 1 is listed by A and by B (one reference each)

The page a node lists for index i holds valid KV for every position of page i before the node's end
on the node's paths; positions after that may belong to another branch.

Namespaces (DESIGN invariant 8). Every path hangs from one root: the shared root (`root`), or the root of its
cache salt's namespace (`roots[salt_key]`, made by the first insert under that salt and gone with its last
node). A walk starts at the root its caller names, so a match never crosses namespaces, and a salted root's
paths are chained from its key in every segment tier (cache/segments/segment.py, salt_key).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from cairn.cache.tree.nodes import (
    DEVICE,
    RELEASE_KV_EVICTED,
    SNAPSHOT_SOURCES,
    LockHandle,
    MatchResult,
    Node,
    SnapshotEntry,
    common_prefix_len,
    page_indices,
)
from cairn.memory.pages import PageAllocator


class RadixTree:
    """Paths of token ids, their KV pages and their snapshots.

    Every mutating call says what it mutates. The clock starts at 0; each lock, insert and
    attach_snapshot advances it by one and stamps with the new value. The tree holds exactly one
    allocator reference per (node, listed page) on every page tier (`allocators`: tier name ->
    PageAllocator, DEVICE first; a node's copy on any other tier is a segment reference, which the
    tree only records). Snapshots leave the tree only through
    `on_snapshot_released(entry, reason)`, the single exit point for a storage tier to free or demote.
    """

    def __init__(
        self,
        page_size: int,
        allocators: dict[str, PageAllocator],
        on_snapshot_released: Callable[[SnapshotEntry, str], None],
    ):
        assert page_size > 0, "the engine's config refuses a page size below 1"
        self.page_size = page_size
        self.allocators = allocators
        self.on_snapshot_released = on_snapshot_released
        self.root = Node(node_id=0, tokens=(), start=0, end=0, parent=None)  # the unsalted paths' root
        self.roots: dict[bytes, Node] = {}  # salt key -> the root of that salt's paths (never empty)
        self.clock = 0  # logical time of the last lock/insert/attach
        self._next_node_id = 1
        self._num_nodes = 0  # nodes below the root
        self._num_snapshots = 0
        self._snapshot_bytes = 0
        self._refs: dict[str, Counter[int]] = {tier: Counter() for tier in allocators}  # page id -> references
        self._locks: set[LockHandle] = set()  # outstanding lock handles

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, root excluded."""
        return self._num_nodes

    @property
    def num_snapshots(self) -> int:
        return self._num_snapshots

    @property
    def snapshot_bytes(self) -> int:
        """Sum of nbytes over the snapshots the tree holds."""
        return self._snapshot_bytes

    def page_refs(self) -> dict[int, int]:
        """Page id -> number of allocator references the tree holds on it (one per node listing it)."""
        return dict(self._refs[DEVICE])

    # ---- reading --------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], need_logits_at_end: bool = True, salt_key: bytes | None = None
              ) -> MatchResult:
        """Longest cached prefix of `tokens` and the deepest usable resume point. Mutates nothing.

        A snapshot at position p is usable iff p <= match_len and p <= len(tokens) and
        (p < len(tokens) or it has logits or not need_logits_at_end): at least one prompt token is
        computed for logits unless the snapshot stores them (DESIGN invariant 1). When a deeper point
        than the resume position is not usable, miss_reason describes the deepest position in
        (resume_position, match_len] that had a snapshot: "needs_logits" if one is there now,
        "evicted" if its snapshot was evicted, and "no_snapshot" if there is none. Only the paths under
        `salt_key`'s root are matched (None: the shared root's).
        """
        path, match_len = self._walk(tokens, salt_key)
        resume_node = None
        for node in path:
            if node.end <= match_len and node.snapshot is not None and self._usable(node, tokens, need_logits_at_end):
                resume_node = node
        resume_position = resume_node.end if resume_node is not None else 0
        miss_reason = None
        if resume_position < match_len:
            miss_reason = self._miss_reason(path, resume_position, match_len)
        return MatchResult(len(tokens), match_len, path, resume_position, resume_node, miss_reason)

    def prefix_page_sources(self, result: MatchResult, num_tokens: int) -> list[tuple[Node, int]]:
        """For each page index of [0, num_tokens): (the deepest node of result.path listing it that starts
        before num_tokens, the page's index in that node's page lists). That node's copy of the page, on
        whichever tier holds it, has valid KV for every position of the page below num_tokens. Pure."""
        if not 0 <= num_tokens <= result.match_len:
            raise ValueError(f"num_tokens {num_tokens} outside the match [0, {result.match_len}]")
        sources: list[tuple[Node, int] | None] = [None] * (-(-num_tokens // self.page_size))
        for node in result.path:
            if node.start >= num_tokens:
                break
            for i, index in enumerate(page_indices(node.start, node.end, self.page_size)):
                if index < len(sources):
                    sources[index] = (node, i)
        return sources

    def iter_nodes(self) -> Iterator[Node]:
        """Every node below the root, parents before children. Do not mutate the tree while iterating."""
        stack = [node for root in (self.root, *self.roots.values()) for node in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def iter_snapshots(self) -> Iterator[tuple[int, SnapshotEntry, Node]]:
        """(position, entry, node) for every snapshot the tree holds."""
        for node in self.iter_nodes():
            if node.snapshot is not None:
                yield node.end, node.snapshot, node

    # ---- locking --------------------------------------------------------------------------------

    def lock(self, result: MatchResult) -> LockHandle:
        """Keep result's KV and resume snapshot from eviction until unlock(). Call right after match().

        Mutates: lock_count +1 on every node of result.path (a partly matched last node too, and
        both halves if it is later split), +1 on the resume node's snapshot; advances the clock and
        stamps every node of result.path and every snapshot at a position <= match_len on it.
        """
        deepest = result.path[-1] if result.path else None
        snapshot = result.resume_node.snapshot if result.resume_node is not None else None
        assert (result.resume_node is None or snapshot is not None) and (deepest is None or self._attached(deepest)), \
            "lock() of a stale MatchResult: the cache locks right after its match, with nothing between"
        self.clock += 1
        handle = LockHandle(node=deepest, snapshot=snapshot, match_len=result.match_len)
        for node in self._ancestors(deepest):
            node.lock_count += 1
            node.last_access = self.clock
            if node.snapshot is not None and node.end <= result.match_len:
                node.snapshot.last_access = self.clock
        if snapshot is not None:
            snapshot.lock_count += 1
        self._locks.add(handle)
        return handle

    def unlock(self, handle: LockHandle) -> None:
        """Undo one lock(). Mutates lock counts only (no recency). Raises ValueError on a second unlock."""
        if handle not in self._locks:
            raise ValueError("unlock() of a handle that is not locked")
        self._locks.remove(handle)
        for node in self._ancestors(handle.node):
            node.lock_count -= 1
        if handle.snapshot is not None:
            handle.snapshot.lock_count -= 1

    # ---- inserting ------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], page_table: list[int], salt_key: bytes | None = None) -> Node:
        """Make `tokens` a path of the tree; returns the node whose end == len(tokens) (root if empty).

        page_table is the caller's page table of the whole path (len >= ceil(len(tokens) / page_size)).
        Mutates: splits nodes so that a node ends at len(tokens) (never moving a snapshot off its
        position), creates nodes for the suffix the tree lacks, listing and increfing page_table's
        pages for their page indices; for tokens already present the tree keeps its own pages and
        takes none of the caller's (the caller still owns and later decrefs its references).
        Advances the clock and stamps every node on the path and every snapshot on it. The path hangs from
        `salt_key`'s root (made if it is the salt's first; None: the shared root).
        """
        self.clock += 1
        return self._insert(tokens, page_table, salt_key)

    def attach_snapshot(self, tokens: Sequence[int], page_table: list[int], entry: SnapshotEntry,
                        salt_key: bytes | None = None) -> bool:
        """insert(tokens, page_table), then hang `entry` at position len(tokens) unless one is there.

        True: attached (stamped with the clock, tombstone at that node cleared, the tree now owns
        the entry). False: the node already holds a snapshot, which is kept; the caller frees its copy.
        """
        if len(tokens) == 0:
            raise ValueError("a snapshot at position 0 is meaningless: resume there by computing from scratch")
        assert entry.nbytes > 0 and entry.lock_count == 0 and entry.source in SNAPSHOT_SOURCES, \
            f"the cache builds every entry it attaches whole and unlocked, from a placement source: {entry}"
        self.clock += 1
        node = self._insert(tokens, page_table, salt_key)
        if node.snapshot is not None:
            return False
        entry.last_access = self.clock
        node.snapshot = entry
        node.snapshot_evicted = node.budget_miss = False
        self._num_snapshots += 1
        self._snapshot_bytes += entry.nbytes
        return True

    # ---- integrity ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if any structural, page, lock or snapshot invariant is broken."""
        refs: dict[str, Counter[int]] = {tier: Counter() for tier in self.allocators}
        num_nodes = num_snapshots = snapshot_bytes = 0
        for node in self.iter_nodes():
            node.check_integrity(self.page_size)
            for tier, counter in refs.items():
                counter.update(node.kv.get(tier, ()))
            num_nodes += 1
            if node.snapshot is not None:
                num_snapshots += 1
                snapshot_bytes += node.snapshot.nbytes
        for key, root in [(None, self.root), *self.roots.items()]:
            if root.snapshot is not None or root.kv or root.tokens or root.end != 0:
                raise AssertionError("the root must be empty: no tokens, pages or snapshot")
            if root.salt_key != key:
                raise AssertionError("a salted root is held under another salt's key")
            if key is not None and not root.children:
                raise AssertionError("a salted root with no path is kept")
        if (num_nodes, num_snapshots, snapshot_bytes) != (self._num_nodes, self._num_snapshots, self._snapshot_bytes):
            raise AssertionError(
                f"totals (nodes, snapshots, bytes) counted {(num_nodes, num_snapshots, snapshot_bytes)}, "
                f"tracked {(self._num_nodes, self._num_snapshots, self._snapshot_bytes)}"
            )
        for tier, counter in refs.items():
            if counter != self._refs[tier]:
                raise AssertionError(f"{tier} page references listed by nodes {dict(counter)} != the tree's count")
        for page, count in refs[DEVICE].items():  # requests hold device pages too
            if self.allocators[DEVICE].refcount[page] < count:
                raise AssertionError(f"page {page}: allocator refcount {self.allocators[DEVICE].refcount[page]} "
                                     f"< tree refs {count}")
        for tier, allocator in self.allocators.items():
            if tier != DEVICE:  # only the tree holds another tier's pages
                allocator.check_integrity(dict(refs[tier]))
        self._check_locks()

    def _check_locks(self) -> None:
        """Lock counts equal what the outstanding handles account for."""
        node_locks: Counter[int] = Counter()
        snapshot_locks: Counter[int] = Counter()
        for handle in self._locks:
            if handle.node is not None and not self._attached(handle.node):
                raise AssertionError("a locked node left the tree")
            node_locks.update(node.node_id for node in self._ancestors(handle.node))
            if handle.snapshot is not None:
                snapshot_locks[id(handle.snapshot)] += 1
        for node in self.iter_nodes():
            if node.lock_count != node_locks[node.node_id]:
                raise AssertionError(
                    f"node {node.node_id}: lock_count {node.lock_count}, handles {node_locks[node.node_id]}"
                )
            entry = node.snapshot
            if entry is not None and entry.lock_count != snapshot_locks.pop(id(entry), 0):
                raise AssertionError(f"snapshot at {node.end}: lock_count {entry.lock_count} disagrees with handles")
        if snapshot_locks:
            raise AssertionError("a locked snapshot left the tree")

    # ---- internals ------------------------------------------------------------------------------

    def root_of(self, salt_key: bytes | None, create: bool = False) -> Node | None:
        """The root of salt_key's paths (the shared root for None); a salted one is made when `create`, else None
        while the salt has no path."""
        if salt_key is None:
            return self.root
        root = self.roots.get(salt_key)
        if root is None and create:
            root = self.roots[salt_key] = Node(node_id=0, tokens=(), start=0, end=0, parent=None, salt_key=salt_key)
        return root

    def _walk(self, tokens: Sequence[int], salt_key: bytes | None) -> tuple[list[Node], int]:
        """(nodes entered, root excluded; tokens matched)."""
        path: list[Node] = []
        node, matched = self.root_of(salt_key), 0
        if node is None:
            return path, matched
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            k = common_prefix_len(child.tokens, tokens, matched)
            path.append(child)
            matched += k
            if k < len(child.tokens):
                break
            node = child
        return path, matched

    @staticmethod
    def _usable(node: Node, tokens: Sequence[int], need_logits_at_end: bool) -> bool:
        return node.end < len(tokens) or node.snapshot.has_logits or not need_logits_at_end

    @staticmethod
    def _miss_reason(path: list[Node], resume_position: int, match_len: int) -> str:
        for node in reversed(path):
            if resume_position < node.end <= match_len:
                if node.snapshot is not None:
                    return "needs_logits"
                if node.snapshot_evicted:
                    return "evicted"
                if node.budget_miss:
                    return "budget"
        return "no_snapshot"

    def _insert(self, tokens: Sequence[int], page_table: list[int], salt_key: bytes | None) -> Node:
        """insert() without advancing the clock: stamps nodes and snapshots with the current tick."""
        if len(page_table) < -(-len(tokens) // self.page_size):
            raise ValueError(f"{len(page_table)} pages cannot hold {len(tokens)} tokens of {self.page_size}")
        node = self.root_of(salt_key, create=True) if len(tokens) else self.root
        while node.end < len(tokens):
            child = node.children.get(tokens[node.end])
            if child is None:
                child = self._new_node(node, tokens, page_table)
            elif (k := common_prefix_len(child.tokens, tokens, node.end)) < len(child.tokens):
                child = self._split(child, node.end + k)
            child.last_access = self.clock
            if child.snapshot is not None:
                child.snapshot.last_access = self.clock
            node = child
        return node

    def _new_node(self, parent: Node, tokens: Sequence[int], page_table: list[int]) -> Node:
        """A leaf under parent for tokens[parent.end:], listing (and increfing) the caller's pages."""
        start, end = parent.end, len(tokens)
        pages = [page_table[i] for i in page_indices(start, end, self.page_size)]
        self._incref(DEVICE, pages)  # first: raises on a free page before the tree changes
        node = Node(self._next_node_id, tuple(tokens[start:end]), start, end, parent, {DEVICE: pages})
        self._next_node_id += 1
        parent.children[node.tokens[0]] = node
        self._num_nodes += 1
        return node

    def _split(self, node: Node, position: int) -> Node:
        """Cut node [s, e) at s < position < e; returns the new upper node [s, position).

        The lower node keeps its identity, children, snapshot and tombstone (they sit at e); the
        upper node has no snapshot and copies lock_count and last_access. Each page-tier copy is cut
        by page index; when position is mid-page both halves list the page containing it, so the tree
        takes one more reference on it. A segment reference covers both halves.
        """
        s, ps = node.start, self.page_size
        head = slice(0, (position - 1) // ps - s // ps + 1)
        tail = slice(position // ps - s // ps, None)
        upper = Node(self._next_node_id, node.tokens[: position - s], s, position, node.parent)
        for tier, copy in node.kv.items():
            paged = tier in self.allocators
            upper.kv[tier] = copy[head] if paged else copy
            node.kv[tier] = copy[tail] if paged else copy
            if paged and position % ps != 0:
                self._incref(tier, [node.kv[tier][0]])
        upper.lock_count, upper.last_access = node.lock_count, node.last_access
        self._next_node_id += 1
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.start, node.parent = node.tokens[position - s :], position, upper
        upper.children[node.tokens[0]] = node
        self._num_nodes += 1
        return upper

    def _remove_leaf(self, node: Node) -> int:
        """Take an unlocked leaf out of the tree; returns the device pages the allocator freed."""
        if node.snapshot is not None:
            self._release_snapshot(node, RELEASE_KV_EVICTED)
        parent = node.parent
        del parent.children[node.tokens[0]]
        if parent.salt_key is not None and not parent.children:  # a salt's last path: its root goes
            del self.roots[parent.salt_key]
        node.parent = None
        self._num_nodes -= 1
        freed = {tier: self._decref(tier, node.kv.pop(tier)) for tier in list(node.kv) if tier in self.allocators}
        node.kv.clear()
        return freed.get(DEVICE, 0)

    def _release_snapshot(self, node: Node, reason: str) -> None:
        """The single exit point of snapshots: unhook, update totals, tell the storage tier."""
        entry = node.snapshot
        assert entry is not None and entry.lock_count == 0, "releasing a missing or locked snapshot"
        node.snapshot = None
        self._num_snapshots -= 1
        self._snapshot_bytes -= entry.nbytes
        self.on_snapshot_released(entry, reason)

    def _ancestors(self, node: Node | None) -> Iterator[Node]:
        """node and its ancestors, root excluded."""
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    def _attached(self, node: Node) -> bool:
        while node.parent is not None:
            node = node.parent
        return node is self.root_of(node.salt_key)

    def _incref(self, tier: str, pages: list[int]) -> None:
        self.allocators[tier].incref(pages)
        self._refs[tier].update(pages)

    def _decref(self, tier: str, pages: list[int]) -> int:
        """Drop the tree's references on `tier`'s pages; returns how many the allocator freed."""
        refs = self._refs[tier]
        refs.subtract(pages)
        for page in pages:
            if refs[page] == 0:
                del refs[page]
        return self.allocators[tier].decref(pages)
