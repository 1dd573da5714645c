"""RemoteFinder: the prefix cache's side of the remote tiers' lookups by prompt.

A remote tier (Redis) holds segments this process never indexed: other replicas wrote them. The cache
asks for a prompt's segments off the engine thread (RemoteLookups) and hangs the answer on its tree
through the tier's index (DiskIndex.hang_found) when it admits or probes that prompt:

    prefetch(token_ids, message_starts, salt_key)   any thread: start the lookup of a prompt in every remote tier;
                       a Future done when the (first) answer is in, None without a remote tier
    hang(token_ids, message_starts, wait, salt_key)  the engine thread: hang each tier's answer on the tree. True when
                       something was hung (match again: nodes may have been split), False when nothing
                       was, None when an answer is still pending and `wait` (admission then waits; a probe
                       passes wait=False and plans without it). A lookup is started where none was.
    deepest_snapshot(token_ids, salt_key)   the deepest snapshot the answers in hand hold for a prompt (0: none yet)
    close()            stop the lookup threads; every lookup not done answers a miss

A remote tier is a SegmentTier (cache/segments/tier.py) over a RedisSegmentStore; `lookup(tier, token_ids,
message_starts)` is what its lookup threads run: one pipelined probe of the prompt's page multiples, message
starts and end (store.py's lookup), answered in stored_paths()'s shape, for the tier's index to hang on the tree.

Without a remote tier every call is a no-op (no lookups, nothing hung), so the cache calls it
unconditionally. A prompt is looked up under its salt key (None: no cache salt), whose chains no other salt's
lookup can reach (segment.salt_key_of), and its answer is kept under it. What this is not: the store's probe
(store.py, chains.py), the lookups' threads and bounds (lookups.py), or the tree's record of found segments
(cache/segments/index.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial

from cairn.cache.remote.lookups import PENDING, RemoteLookups
from cairn.cache.remote.store import RedisSegmentStore
from cairn.cache.segments.index import DiskIndex
from cairn.cache.segments.tier import SegmentTier
from cairn.cache.tree.nodes import DiskRef


class RemoteFinder:
    def __init__(self, tiers: Sequence, indexes: dict[str, DiskIndex]):
        """`tiers`: the cache's tiers (the remote ones are picked); `indexes`: segment tier name -> its index."""
        self.lookups = {t.name: RemoteLookups(partial(lookup, t)) for t in tiers
                        if t.pages is None and isinstance(t.store, RedisSegmentStore)}
        self._indexes = indexes

    def prefetch(self, token_ids: Sequence[int], message_starts: Sequence[int], salt_key: bytes | None = None
                 ) -> Future | None:
        futures = [lookups.start(token_ids, message_starts, salt_key) for lookups in self.lookups.values()]
        return futures[0] if futures else None

    def hang(self, token_ids: Sequence[int], message_starts: Sequence[int], wait: bool, salt_key: bytes | None = None
             ) -> bool | None:
        hung = False
        for name, lookups in self.lookups.items():
            found = lookups.answer(token_ids, salt_key)
            if found is None:
                lookups.start(token_ids, message_starts, salt_key)
                found = PENDING
            if found is PENDING:
                if wait:
                    return None
                continue
            hung = self._indexes[name].hang_found(found) or hung
        return hung

    def deepest_snapshot(self, token_ids: Sequence[int], salt_key: bytes | None = None) -> int:
        return max([0, *(lookups.deepest_snapshot(token_ids, salt_key) for lookups in self.lookups.values())])

    def close(self) -> None:
        for lookups in self.lookups.values():
            lookups.close()


def probe_positions(page_size: int, num_tokens: int, message_starts: Sequence[int] = ()) -> list[int]:
    """Where a prompt of num_tokens looks for index entries: page multiples, message starts, its end."""
    grid = range(page_size, num_tokens + 1, page_size)
    return sorted({*grid, *(p for p in message_starts if 0 < p <= num_tokens), num_tokens})


def lookup(tier: SegmentTier, token_ids: Sequence[int], message_starts: Sequence[int] = (),
           salt_key: bytes | None = None) -> list[tuple[tuple[int, ...], int, DiskRef, bool, bool, bytes | None]]:
    """(path tokens [0, end), start, ref, has_snapshot, has_logits, salt_key) for each segment of the deepest chain
    of this prompt under salt_key's root that `tier`'s Redis store holds ending in a snapshot, parents first; [] on
    a miss or while Redis is down. Counted among the tier's operations (lookups, lookup_hits, and the store's waits
    for another replica's write: lookups_waited, lookup_waits_expired, markers.py)."""
    store: RedisSegmentStore = tier.store
    infos = store.lookup(token_ids, probe_positions(tier.page_size, len(token_ids), message_starts), salt_key)
    tier.counters["lookups"] += 1
    tier.counters["lookup_hits"] += bool(infos)
    for name in ("lookups_waited", "lookup_waits_expired"):
        tier.counters[name] = store.counted(name)
    return [(tuple(token_ids[: i.start_position + i.num_tokens]), i.start_position,
             DiskRef(i.key, i.start_position, i.start_position + i.num_tokens), i.has_snapshot, i.has_logits, salt_key)
            for i in infos]
