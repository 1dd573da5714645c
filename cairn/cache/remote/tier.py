"""RemoteTier: a segment tier (a `LowerTier`, tiers/base.py) over a shared Redis (RedisSegmentStore).

It is a SegmentTier with its own name (REMOTE) and store: segments are exactly the disk tier's (same keys,
segment_key(canonical parent key, tokens); same format; same compatibility namespace), so a chain one
replica wrote is read by any replica of the same weights. What differs from SegmentTier:

    persist(path, source)   skips a node whose segment the store already knows (another replica wrote it,
                    or a lookup found it) without reading its KV, recording the reference on the node; the
                    store queues the writes behind the request (a background thread sends them)
    lookup(token_ids, message_starts)   what Redis holds for a prompt: one pipelined probe of the prompt's
                    page multiples, message starts and end; the deepest chain ending in a snapshot, in
                    stored_paths()'s shape, for the cache's index to hang on the tree at admission

What this is not: the decision of when to look up or what to write (the cache's, through the tier
protocol and its index), nor the Redis client, breaker or write queue (store.py, client.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from cairn.cache.remote.store import RedisSegmentStore
from cairn.cache.segments.segment import segment_key
from cairn.cache.segments.store import SegmentInfo
from cairn.cache.segments.tier import SegmentTier
from cairn.cache.tiers.base import Source
from cairn.cache.tree.nodes import REMOTE, DiskRef, Node

REMOTE_BANDWIDTH = 0.25e9  # bytes/s of a restore from Redis until measured (the planner then observes loads)


class RemoteTier(SegmentTier):
    def __init__(self, store: RedisSegmentStore, page_size: int, write_through: bool = True, name: str = REMOTE,
                 bandwidth: float = REMOTE_BANDWIDTH):
        super().__init__(store, page_size, write_through, name, bandwidth)  # type: ignore[arg-type] (same interface)

    relinks_below = False  # a rewritten segment's descendants come back through lookups (off the engine thread)

    def _remove_orphans(self, keys: list[bytes]) -> None:
        """Nothing: in a store shared with other replicas, a segment whose parent this process does not know
        is not an orphan (its known keys are what lookups found)."""

    def persist(self, path: list[Node], source: Source) -> int:
        """Queue every node of `path` (root to node) that the store lacks (or holds without the snapshot the
        node now has); returns segments queued. Stops at the first refusal: a later node would be
        unreachable without it. Every segment is read (from `source`) before the first is queued, so that
        the markers of the deeper ones are set before the shallower ones land (markers.py).

        Which nodes are written is SegmentTier._to_write's rule (with a slice of a longer stored segment just
        above one to write: at a request's end, `source` reads its KV from the request's pages)."""
        segments = []  # read first, queued together: no segment lands before a deeper one is announced
        for node, parent_key in self._to_write(path):
            kv = source.node_kv(node)
            if kv is None:
                self.counters["write_unreadable"] += 1
                break
            segments.append((node, self._segment(node, parent_key, kv, source.node_snapshot(node))))
        queued = 0
        for node, segment in segments:
            if not self.store.put(segment):
                self.counters["write_failed"] += 1
                return queued
            self._wrote(node, segment)
            queued += 1
        return queued

    def operations(self) -> dict[str, int]:
        """As SegmentTier's, but `segments_written` counts the segments Redis accepted (the store's background
        writer) and `segments_queued` those queued behind requests, of which Redis may refuse some."""
        ops = super().operations()
        ops["segments_queued"] = ops.pop("segments_written", 0)
        ops["segments_written"] = self.store.counted("written")
        return ops

    def _known(self, node: Node, parent_key: bytes | None) -> bool:
        """The store already holds node's segment, with its snapshot when it has one (recorded on the node). A
        reference on the node to a segment the store has forgotten since (a value found gone takes the segments
        below it along: store.py) is not known: the tree drops it at the next forget, and this write is the one
        that puts the path back whole."""
        if super()._known(node, parent_key) and self.store.info(node.kv[self.name].key) is not None:
            return True
        key = segment_key(parent_key, node.tokens)
        info: SegmentInfo | None = self.store.info(key)
        if info is None or (node.snapshot is not None and not _covers(info, node.snapshot.has_logits)):
            return False
        self._record(node, key, node.snapshot is not None)
        return True

    def probe_positions(self, num_tokens: int, message_starts: Sequence[int] = ()) -> list[int]:
        """Where a prompt of num_tokens looks for index entries: page multiples, message starts, its end."""
        grid = range(self.page_size, num_tokens + 1, self.page_size)
        return sorted({*grid, *(p for p in message_starts if 0 < p <= num_tokens), num_tokens})

    def lookup(self, token_ids: Sequence[int], message_starts: Sequence[int] = ()
               ) -> list[tuple[tuple[int, ...], int, DiskRef, bool, bool]]:
        """(path tokens [0, end), start, ref, has_snapshot, has_logits) for each segment of the deepest stored
        chain of this prompt that ends in a snapshot, parents first; [] on a miss or while Redis is down."""
        infos = self.store.lookup(token_ids, self.probe_positions(len(token_ids), message_starts))
        self.counters["lookups"] += 1
        self.counters["lookup_hits"] += bool(infos)
        for name in ("lookups_waited", "lookup_waits_expired"):  # for another replica's write (markers.py)
            self.counters[name] = self.store.counted(name)
        return [(tuple(token_ids[: i.start_position + i.num_tokens]), i.start_position,
                 DiskRef(i.key, i.start_position, i.start_position + i.num_tokens), i.has_snapshot, i.has_logits)
                for i in infos]


def _covers(info: SegmentInfo, has_logits: bool) -> bool:
    """A stored segment can stand for a node's snapshot: it holds one, with logits when the node's has them."""
    return info.has_snapshot and (info.has_logits or not has_logits)
