"""RemoteTier: the disk tier's segments, written to and read from a shared Redis (RedisSegmentStore).

Segments are exactly the disk tier's: same keys (segment_key(canonical parent key, tokens)), same
format, same compatibility namespace, so a chain one replica wrote is read by any replica of the
same weights. What differs from DiskTier:

    persist(path, kv_pages, snapshot_of)   writes what the store does not hold yet, judged by the
                    segment keys themselves (it records nothing on the tree's nodes, whose `disk` field
                    belongs to the disk tier); the store queues the writes behind the request
    lookup(token_ids, message_starts)      what Redis holds for a prompt that no local tier resumes
                    deeply: one pipelined probe of the prompt's page multiples, message starts and end;
                    the deepest chain ending in a snapshot, in stored_paths()'s shape, to hang on the tree
    read / kv_of / snapshot_of             as DiskTier's (every value fully verified by the store)

What this is not: the decision of when to look up or what to write (the cache's, through the tier
protocol), nor the Redis client, breaker or write queue (store.py, client.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from cairn.cache.disk.segment import segment_key
from cairn.cache.disk.tier import DiskTier
from cairn.cache.remote.store import RedisSegmentStore
from cairn.cache.tree.nodes import DiskRef, Node


class RemoteTier(DiskTier):
    name = "remote"

    def __init__(self, store: RedisSegmentStore, page_size: int, write_through: bool = True):
        super().__init__(store, page_size, write_through)  # type: ignore[arg-type]  (the same interface)

    def persist(self, path: list[Node], kv_pages: callable, snapshot_of: callable) -> int:
        """Queue every node of `path` (root to node) that the store lacks (or holds without the snapshot
        the node now has); returns segments queued. Stops at the first refusal: a later node would be
        unreachable without it."""
        queued = 0
        for node, parent_key in self._prefix_keys(path):
            info = self.store.info(segment_key(parent_key, node.tokens))
            if info is not None and (node.snapshot is None or info.has_snapshot):
                continue
            kv = kv_pages(node)
            if kv is None:
                self.counters["write_unreadable"] += 1
                return queued
            if not self.store.put(self._segment(node, parent_key, kv, snapshot_of(node))):
                self.counters["write_failed"] += 1
                return queued
            queued += 1
            self.counters["segments_written"] += 1
        return queued

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
        return [(tuple(token_ids[: i.start_position + i.num_tokens]), i.start_position,
                 DiskRef(i.key, i.start_position, i.start_position + i.num_tokens), i.has_snapshot, i.has_logits)
                for i in infos]
