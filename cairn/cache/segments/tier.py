"""SegmentTier: a segment tier (a `LowerTier`, tiers/base.py): radix-tree nodes as segments in a store of segments
(a `SegmentStore`, store.py: the disk's or Redis's), and the tree rebuilt from the segments at start-up.

A node [start, end) is written as one segment: its tokens, the KV pages of its page indices (whole
pages, as stored on the device), and the snapshot (with logits) at its end when it has one. Its
parent key is the canonical key of the path before it, segment_key(root, path[:start]), so a segment
names its prefix whatever node boundaries the writer had, and equal prefixes get equal keys across
requests, restarts and servers. The root is the path's salt key for a salted path (its first segment names it
as its parent key), None (ROOT_KEY) otherwise: no key of one cache salt is another's (segment.salt_key_of). A
snapshot is only resumable from disk when every node above it is on disk too, so `persist` writes the missing
ancestors first, and a chain continues only from a segment's end, so an ancestor that is the front slice of a
longer segment is written again as a segment of its own.

The namespace is the compatibility digest (cairn/engine/compat.py, computed by the engine): the model
weights' content digest, the architecture, dtypes, page size and format version (with exact resumption, the
prefill block and the kernels a prefill's linears run on too). A segment of
another model is never read.

Each store of segments is one SegmentTier instance with its own name and store, placed in the factory's tier
list (cache/factory.py): the disk tier (DISK over a DiskStore) and the remote tier (REMOTE over a
RedisSegmentStore), whose segments are exactly the disk tier's (same keys, format and compatibility namespace),
so a chain one replica wrote is read by any replica of the same weights. What the kind of store changes (its
`shared` and `write_behind`, store.py), and nothing else:

    shared          persist skips a node whose segment the store already holds (another replica wrote it, or a
                    lookup found it) without reading its KV, recording the reference on the node, and rewrites
                    one the node records but the store has forgotten; a segment whose parent this process does
                    not know is not an orphan (nothing is removed at start-up), and what lies below a segment
                    written again comes back through lookups (relinks_below is False)
    write_behind    persist reads every segment of the path before putting the first (the store queues them
                    behind the request), and operations() counts its puts as segments_queued and the writes
                    that landed as segments_written

What this is not: the segment format (segment.py), a store (cache/disk/store.py, cache/remote/store.py), the
lookup of a prompt in Redis (remote/finder.py), or the choice of what to write when (the cache decides).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from cairn.cache.segments.named_bytes import layout_meta, read_layout
from cairn.cache.segments.segment import Segment, _tokens_to_bytes, path_hasher, segment_key
from cairn.cache.segments.store import SegmentInfo, SegmentStore
from cairn.cache.tiers.base import KV, Source, State, Unreadable
from cairn.cache.tree.nodes import DISK, DiskRef, Node, page_indices
from cairn.memory.state_pool import StatePool

log = logging.getLogger(__name__)
# a store's reason for a read that found no segment -> the tier's counter of it
READ_COUNTERS = {"evicted": "read_vanished", "corrupt": "read_bad", "unavailable": "read_unavailable"}


def _path_to(node: Node) -> list[Node]:
    """The nodes from the root's child down to node."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _byte_tensor(data: bytes | memoryview) -> torch.Tensor:
    """A uint8 tensor over `data`: a view when it is writable (as segments read from disk are), else a copy."""
    if not (isinstance(data, memoryview) and not data.readonly):
        data = bytearray(data)
    return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def _from_bytes(data: bytes | memoryview, meta: dict) -> torch.Tensor:
    """A tensor over `data` (no copy when it is a writable view)."""
    return _typed(_byte_tensor(data), meta["dtype"], meta["shape"])


def _typed(raw: torch.Tensor, dtype_name: str, shape) -> torch.Tensor:
    """The bytes `raw` (a uint8 tensor) as a tensor of that dtype and shape: a view when `raw` starts at a
    multiple of the dtype's size in its storage, else a copy."""
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


def snapshot_fields(tensors: dict[str, torch.Tensor]) -> dict:
    """The snapshot section (the named tensors back to back, in one device-to-host copy) and its meta."""
    flat = [t.detach().contiguous().view(torch.uint8).reshape(-1) for t in tensors.values()]
    data = torch.cat(flat).cpu().numpy().tobytes() if flat else b""
    meta = layout_meta([(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items()])
    return {"snapshot_bytes": data, "snapshot_meta": meta}


def _meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype), "shape": list(t.shape)}


@dataclasses.dataclass
class SnapshotTensors:
    """A snapshot read back from disk."""

    tensors: dict[str, torch.Tensor]  # as StatePool.read_slot names them (views of the segment's bytes)
    logits: torch.Tensor | None


class SegmentTier:
    """A segment tier (a `LowerTier`) over a `SegmentStore` (store.py), every storage call through it.

    The disk tier is one instance (name DISK over a DiskStore), the remote tier another (name REMOTE over a
    RedisSegmentStore): the module docstring says what the kind of store changes. It is not a page tier: it holds no
    working slot and its budget is the store's (`fits` is always true: the store evicts least-recently-used
    segments itself; the cache's stats read the store's bytes).

    `restore_buffer`: a store that reads into a reuse buffer (DiskStore, its ReadBuffer) reads the segment of a
    snapshot being restored into this one buffer (no allocation or page faults per restore); the snapshot is
    copied out of it before load_snapshot returns. None: each read gets its own bytes (a store whose values
    arrive whole)."""

    pages = None  # no page allocator: nodes reference segments

    def __init__(self, store: SegmentStore, page_size: int, write_through: bool = True, name: str = DISK,
                 bandwidth: float = 0.5e9, restore_buffer: object | None = None):
        self.name, self.store, self.page_size, self.bandwidth = name, store, page_size, bandwidth
        self.write_through = write_through  # persist every finished request (else only host evictions)
        self.counters: Counter[str] = Counter()
        self._restore_buffer = restore_buffer
        self.on_written: Callable[[bytes], None] | None = None  # told each segment key `persist` wrote (the index)
        self._restore_lock = threading.Lock()  # one restore at a time uses the buffer

    @property
    def relinks_below(self) -> bool:
        """The index reads a rewritten segment's descendants here (`paths_below`; no I/O elsewhere); not in a shared
        store, where they come back through lookups (off the engine thread)."""
        return not self.store.shared

    # ---- the LowerTier protocol -------------------------------------------------------------------

    def fits(self, with_logits: bool) -> bool:
        return True

    def kv_fits(self, num_pages: int) -> bool:
        return True

    def store_snapshot(self, node: Node, source: Source) -> bytes | None:
        """Write node's path (its snapshot with it); the key of the segment holding the snapshot, or None."""
        self.persist(_path_to(node), source)
        return node.snapshot.handle.copies.get(self.name)

    def store_kv(self, node: Node, source: Source) -> DiskRef | None:
        """Write node's path where it is not yet in a segment; node's segment reference, or None."""
        self.persist(_path_to(node), source)
        return node.kv.get(self.name)

    def load_snapshot(self, key: bytes, dst: StatePool, slot: int) -> torch.Tensor | None | Unreadable:
        """Read the segment (into the restore buffer when there is one), verify it and copy its snapshot
        into dst[slot]; its logits are a copy of their own. Why not when the segment is missing or bad (a whole
        segment without the snapshot its record promised is "corrupt")."""
        with self._restore_lock:
            segment = self.read(key, self._restore_buffer)
            if isinstance(segment, str):
                return segment
            snap = self.snapshot_of(segment)
            if snap is None:
                return "corrupt"
            dst.write_slot(slot, snap.tensors)
            return None if snap.logits is None else snap.logits.to(dst.device, copy=True)

    def read_snapshot(self, key: bytes) -> State | None:
        segment = self.read(key)
        snap = None if isinstance(segment, str) else self.snapshot_of(segment)
        return None if snap is None else (snap.tensors, snap.logits)

    def free_snapshot(self, key: bytes) -> None:
        """Nothing: the segment file stays (the store evicts it, least recently used first)."""

    def read_kv(self, node: Node) -> KV | None:
        segment = self.read(node.kv[self.name].key)
        if isinstance(segment, str):
            return None
        k, v = self.kv_of(segment)
        first = self._page_offset(node, 0)
        count = len(page_indices(node.start, node.end, self.page_size))
        return k[:, first:first + count], v[:, first:first + count]

    def read_page(self, node: Node, i: int, cache: dict) -> KV | Unreadable:
        """node's i-th page, or why its segment is unreadable; `cache` keeps each segment read once per load (its
        (k, v), or why not)."""
        key = node.kv[self.name].key
        if key not in cache:
            segment = self.read(key)
            cache[key] = segment if isinstance(segment, str) else self.kv_of(segment)
        if isinstance(cache[key], str):
            return cache[key]
        k, v = cache[key]
        j = self._page_offset(node, i)
        return k[:, j], v[:, j]

    def _page_offset(self, node: Node, i: int) -> int:
        return node.start // self.page_size + i - node.kv[self.name].segment_start // self.page_size

    # ---- writing ----------------------------------------------------------------------------------

    def persist(self, path: list[Node], source: Source) -> int:
        """Write every node of `path` (root to node, in order) that has no segment here (and the slices
        `_to_write` adds); returns segments written (queued, in a write-behind store).

        source.node_kv(node) -> (k, v) tensors of the node's pages, or None when they cannot be read (a
        bad segment, which the store then reports); source.node_snapshot(node) -> (named state tensors,
        logits) or None. Stops at the first node it cannot read and at the first failed write (a later node
        would be unreachable without it). Each segment is read just before it is put, but in a write-behind
        store, where every one is read before the first is queued: the markers of the deeper ones are then set
        before the shallower ones land (remote/markers.py).
        """
        segments = self._segments(self._to_write(path), source)
        return self._put_each(list(segments) if self.store.write_behind else segments)

    def _segments(self, steps: list[tuple[Node, bytes | None]], source: Source) -> Iterator[tuple[Node, Segment]]:
        """(node, its segment) for each of `steps`, read from `source` when asked for; stops at a node whose KV
        cannot be read (counted in write_unreadable)."""
        for node, parent_key in steps:
            kv = source.node_kv(node)
            if kv is None:
                self.counters["write_unreadable"] += 1
                return
            yield node, self._segment(node, parent_key, kv, source.node_snapshot(node))

    def _put_each(self, segments) -> int:
        """Put each (node, segment) into the store in order, recording it on its node; stops at the first refusal
        (counted in write_failed). Returns the segments put."""
        put = 0
        for node, segment in segments:
            if not self.store.put(segment):
                self.counters["write_failed"] += 1
                return put
            self._wrote(node, segment)
            put += 1
        return put

    def _to_write(self, path: list[Node]) -> list[tuple[Node, bytes | None]]:
        """(node, canonical key of the path before it) for each node of a root-to-node `path` to write here,
        in order: every node this tier does not hold (`_known`), and a held node just above one of those that
        is a slice of a longer segment.

        A chain continues only from a segment's END (a segment's parent key names the path before it, and at
        start-up a segment hangs only below one ending there). A prompt that leaves a stored conversation
        inside a segment, where no snapshot is taken (--prefill-block), splits its node: the front is a slice
        of the stored segment, and the new conversation's first segment would chain to the slice's end, which
        no segment has (an orphan after a restart; a store that checks parents refuses it). So the slice is
        written again as a segment of its own (counted in slices_rewritten):

            stored     [0 ................ 64)          one segment, A
            new path   [0 .. 20)[20 ........ 64)...     [0, 20) a slice of A: rewritten before [20, ...)
        """
        steps = list(self._prefix_keys(path))
        todo = [not self._known(node, parent_key) for node, parent_key in steps]
        for j in range(len(steps) - 1, 0, -1):
            if todo[j] and not todo[j - 1] and self._is_slice(steps[j - 1][0]):
                todo[j - 1] = True
                self.counters["slices_rewritten"] += 1
        return [step for step, write in zip(steps, todo, strict=True) if write]

    def _known(self, node: Node, parent_key: bytes | None) -> bool:
        """node's segment here is recorded on it, with its snapshot when it has one.

        In a shared store, a recorded reference to a segment the store has forgotten since (a value found gone
        takes the segments below it along: remote/store.py) is not known: the tree drops it at the next forget,
        and this write is the one that puts the path back whole. And a segment the store holds that node does not
        record (another replica wrote it, or a lookup found it) is known, with its snapshot when it has one (and
        logits when the node's has them): recorded on the node now, its KV never read."""
        recorded = self.name in node.kv and (node.snapshot is None or self.name in node.snapshot.handle.copies)
        if not self.store.shared:
            return recorded
        if recorded and self.store.info(node.kv[self.name].key) is not None:
            return True
        key = segment_key(parent_key, node.tokens)
        info = self.store.info(key)
        if info is None or (node.snapshot is not None and not _covers(info, node.snapshot.has_logits)):
            return False
        self._record(node, key, node.snapshot is not None)
        return True

    def _is_slice(self, node: Node) -> bool:
        """node's segment here goes on past node's end (node was split off its front)."""
        ref = node.kv.get(self.name)
        return ref is not None and ref.segment_end != node.end

    def operations(self) -> dict[str, int]:
        """What the tier did, for /metrics (cairn_cache_{disk,remote}_operations_total{kind}): its counters. A
        write-behind store's puts are only queued: they count as `segments_queued`, and `segments_written` is the
        store's count of the writes that landed (Redis accepted), of which Redis may refuse some."""
        ops = dict(self.counters)
        if self.store.write_behind:
            ops["segments_queued"] = ops.pop("segments_written", 0)
            ops["segments_written"] = self.store.counted("written")
        return ops

    def _wrote(self, node: Node, segment: Segment) -> None:
        """`segment`, node's, was just put into the store: record it on node, count it, tell `on_written`."""
        self._record(node, segment.key, segment.snapshot_bytes is not None)
        self.counters["segments_written"] += 1
        if self.on_written is not None:
            self.on_written(segment.key)

    def _record(self, node: Node, key: bytes, with_snapshot: bool) -> None:
        node.kv[self.name] = DiskRef(key, node.start, node.end)
        if with_snapshot:
            node.snapshot.handle.copies[self.name] = key

    @staticmethod
    def _prefix_keys(path: list[Node]) -> Iterator[tuple[Node, bytes | None]]:
        """(node, canonical key of the path before it) for each node of a root-to-node path: for the first node,
        its root's salt key (None for the shared root)."""
        root = path[0].parent.salt_key if path and path[0].parent is not None else None
        h = path_hasher(root)
        for node in path:
            yield node, (h.copy().digest() if node.start else root)
            h.update(_tokens_to_bytes(node.tokens))

    def _segment(self, node: Node, parent_key: bytes | None, kv, snapshot) -> Segment:
        k, v = kv
        kv_tensor = torch.stack([k, v])
        fields = dict(key=segment_key(parent_key, node.tokens), parent_key=parent_key, start_position=node.start,
                      tokens=node.tokens, kv_bytes=_to_bytes(kv_tensor), kv_meta=_meta(kv_tensor))
        if snapshot is not None:
            tensors, logits = snapshot
            fields.update(snapshot_fields(tensors))
            if logits is not None:
                fields.update(logits_bytes=_to_bytes(logits.float()), logits_meta=_meta(logits.float()))
        return Segment(**fields)

    # ---- reading ----------------------------------------------------------------------------------

    def read(self, key: bytes, buffer: object | None = None) -> Segment | Unreadable:
        """The verified segment, pinned while read; else (counted) the store's reason: "evicted", "corrupt" or
        "unavailable" when missing, bad or out of reach. Its bytes are read into `buffer` when given (valid until
        that buffer's next read)."""
        if not self.store.pin(key):  # the store let it go already (evicted, a failed write)
            self.counters["read_missing"] += 1
            return "evicted"
        try:
            got = self.store.read(key) if buffer is None else self.store.read(key, buffer)
        finally:
            self.store.unpin(key)
        if not isinstance(got, str):
            self.counters["read_ok"] += 1
            return got
        self.counters[READ_COUNTERS[got]] += 1
        return got

    @staticmethod
    def kv_of(segment: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of the segment's pages: [layers, pages, page_size, kv_heads, head_dim] each."""
        kv = _from_bytes(segment.kv_bytes, segment.kv_meta)
        return kv[0], kv[1]

    @staticmethod
    def snapshot_of(segment: Segment) -> SnapshotTensors | None:
        if segment.snapshot_bytes is None:
            return None
        data = _byte_tensor(segment.snapshot_bytes)  # its layout was checked when the segment was decoded
        # views of one storage, so that StatePool.write_slot copies each group of equal tensors at once
        tensors = {t.name: _typed(data[t.offset:t.offset + t.nbytes], t.dtype, t.shape)
                   for t in read_layout(segment.snapshot_meta, data.numel())}
        logits = None if segment.logits_bytes is None else _from_bytes(segment.logits_bytes, segment.logits_meta)
        return SnapshotTensors(tensors, logits)

    # ---- start-up -----------------------------------------------------------------------------------

    def stored_paths(self) -> Iterator[tuple[tuple[int, ...], int, DiskRef, bool, bool, bytes | None]]:
        """(path tokens [0, end), start, ref, has_snapshot, has_logits, salt key) for every indexed segment whose
        prefix chain is complete, parents before children (a segment at position 0 with a parent key begins a
        salted path: that key is its salt key). Orphans (a missing parent: evicted, or a file
        found bad, which leaves every segment below it unreachable) are counted and, once every segment
        was seen, deleted by the store's lock holder: they would take the budget and be scanned at
        every start for nothing."""
        orphans: list[bytes] = []
        yield from self._chains(None, orphans)
        self._remove_orphans(orphans)

    def paths_below(self, path: tuple[int, ...], salt_key: bytes | None = None
                    ) -> list[tuple[tuple[int, ...], int, DiskRef, bool, bool, bytes | None]]:
        """As stored_paths, the indexed segments chained below `path` (under salt_key's root) alone (whose own
        segment was just written again, after it was found bad: what lies below it was unreachable meanwhile);
        reads their tokens only."""
        return list(self._chains((path, salt_key), []))

    def _chains(self, below: tuple[tuple[int, ...], bytes | None] | None, orphans: list[bytes]):
        """Walk the indexed segments parents first, yielding each whose prefix chain is complete: from a root
        (below None; a segment that does not chain is counted and appended to `orphans`) or from the end of
        `below`, a (path, salt key) (the others are skipped unread)."""
        infos = [self.store.info(k) for k in self.store.keys()]  # noqa: SIM118 (a store, not a dict)
        infos = sorted((i for i in infos if i is not None), key=lambda i: (i.start_position, i.key))
        wanted = Counter(i.parent_key for i in infos if i.parent_key is not None)
        # canonical key of a path's end -> (the path, its salt key)
        paths: dict[bytes, tuple[tuple[int, ...], bytes | None]] = {}
        if below is not None:
            paths[segment_key(below[1], below[0])] = below
        for info in infos:
            if info.start_position == 0:  # a path's first segment: its parent key is its salt key (or None)
                prefix = ((), info.parent_key) if below is None else None
            else:
                prefix = paths.get(info.parent_key)
            if prefix is None and below is not None:
                continue
            tokens = self.store.get_tokens(info.key)
            if tokens is None or prefix is None or len(prefix[0]) != info.start_position:
                if below is None:
                    self.counters["orphan_segments"] += 1
                    orphans.append(info.key)
                continue
            path, salt = prefix[0] + tokens, prefix[1]
            end_key = segment_key(salt, path)
            if wanted[end_key]:
                paths[end_key] = path, salt
            yield path, info.start_position, DiskRef(info.key, info.start_position, len(path)), \
                info.has_snapshot, info.has_logits, salt

    def _remove_orphans(self, keys: list[bytes]) -> None:
        """Delete them, but from a shared store: there a segment whose parent this process does not know is not an
        orphan (the keys it knows are what lookups found)."""
        if self.store.shared:
            return
        freed = self.store.remove_unreachable(keys) if keys else 0
        if freed:
            log.info("%s cache: deleted %d segments whose prefix is gone (%.1f MiB): none could be resumed",
                     self.name, len(keys), freed / 2**20)


def _covers(info: SegmentInfo, has_logits: bool) -> bool:
    """A stored segment can stand for a node's snapshot: it holds one, with logits when the node's has them."""
    return info.has_snapshot and (info.has_logits or not has_logits)
