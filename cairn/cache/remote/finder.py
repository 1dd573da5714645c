"""RemoteFinder: the prefix cache's side of the remote tiers' lookups by prompt.

A remote tier (Redis) holds segments this process never indexed: other replicas wrote them. The cache
asks for a prompt's segments off the engine thread (RemoteLookups) and hangs the answer on its tree
through the tier's index (DiskIndex.hang_found) when it admits or probes that prompt:

    prefetch(token_ids, message_starts)   any thread: start the lookup of a prompt in every remote tier;
                       a Future done when the (first) answer is in, None without a remote tier
    hang(token_ids, message_starts, wait)  the engine thread: hang each tier's answer on the tree. True when
                       something was hung (match again: nodes may have been split), False when nothing
                       was, None when an answer is still pending and `wait` (admission then waits; a probe
                       passes wait=False and plans without it). A lookup is started where none was.
    deepest_snapshot(token_ids)   the deepest snapshot the answers in hand hold for a prompt (0: none yet)
    close()            stop the lookup threads; every lookup not done answers a miss

Without a remote tier every call is a no-op (no lookups, nothing hung), so the cache calls it
unconditionally. What this is not: the lookup itself (RemoteTier.lookup), its threads and bounds
(lookups.py), or the tree's record of found segments (cache/disk/index.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from cairn.cache.remote.lookups import PENDING, RemoteLookups
from cairn.cache.remote.tier import RemoteTier
from cairn.cache.segments.index import DiskIndex


class RemoteFinder:
    def __init__(self, tiers: Sequence, indexes: dict[str, DiskIndex]):
        """`tiers`: the cache's tiers (the remote ones are picked); `indexes`: segment tier name -> its index."""
        self.lookups = {t.name: RemoteLookups(t.lookup) for t in tiers if isinstance(t, RemoteTier)}
        self._indexes = indexes

    def prefetch(self, token_ids: Sequence[int], message_starts: Sequence[int]) -> Future | None:
        futures = [lookups.start(token_ids, message_starts) for lookups in self.lookups.values()]
        return futures[0] if futures else None

    def hang(self, token_ids: Sequence[int], message_starts: Sequence[int], wait: bool) -> bool | None:
        hung = False
        for name, lookups in self.lookups.items():
            found = lookups.answer(token_ids)
            if found is None:
                lookups.start(token_ids, message_starts)
                found = PENDING
            if found is PENDING:
                if wait:
                    return None
                continue
            hung = self._indexes[name].hang_found(found) or hung
        return hung

    def deepest_snapshot(self, token_ids: Sequence[int]) -> int:
        return max([0, *(lookups.deepest_snapshot(token_ids) for lookups in self.lookups.values())])

    def close(self) -> None:
        for lookups in self.lookups.values():
            lookups.close()
