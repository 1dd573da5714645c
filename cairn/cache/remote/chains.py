"""ChainLookup: the read side of RedisSegmentStore's index, a prompt's deepest stored chain (mixed into the store).

    lookup(tokens, positions)   one pipelined round trip probing the index entries and markers at those
                     prefix positions of a prompt (keys.py, markers.py); the deepest chain ending in a
                     snapshot is registered in the store's index and returned, parents first ([] on a miss
                     or while Redis is down). While another replica's marker announces a deeper chain, the
                     probe is repeated every WAIT_POLL_S until it has landed, the marker is gone, or the
                     store's wait_s has passed (counted: lookups_waited, lookup_waits_expired)
    counted(name)    one of the store's counts

It uses the store's state (redis, names, markers, epoch, wait_s, _lock, _counts, _index (record.py's
KnownSegments), _trim, _fault, saw_epoch, read_maxmemory), set up by RedisSegmentStore.__init__; it is not used
alone. What this is not: the writes, or the reading of a segment's bytes (store.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from itertools import pairwise

from cairn.cache.remote.client import FAILED
from cairn.cache.remote.keys import IndexEntry, canonical_hasher, chain_keys, entry_at, prefix_keys
from cairn.cache.remote.record import KnownSegment
from cairn.cache.segments.segment import _tokens_to_bytes
from cairn.cache.segments.store import SegmentInfo

WAIT_POLL_S = 0.02  # how often a waiting lookup probes again


class ChainLookup:
    def lookup(self, tokens: Sequence[int], positions: Iterable[int], salt_key: bytes | None = None
               ) -> list[SegmentInfo]:
        """Probe the index entries at these prefix positions of tokens (chained from salt_key's root) in one round
        trip; register the deepest chain that ends in a snapshot and return its segments, parents first ([] on a
        miss or when down). While another replica's marker announces a deeper one, probe again (see the module
        docstring)."""
        keys = prefix_keys(tokens, positions, salt_key)
        if not keys:  # an empty prompt (the server looks it up before the engine refuses it): Redis is not asked
            return []
        order = sorted(keys, reverse=True)
        epoch = self.epoch.probe()  # read (only) first: a Redis that lost its segments is noticed before the chain
        probes = epoch + [("get", name(keys[p])) for name in (self.names.entry, self.names.marker) for p in order]
        deadline, waited, infos = time.monotonic() + self.wait_s, False, []
        while True:
            values = self.redis.pipelined(probes)
            if values is FAILED:
                break
            self.saw_epoch(values[len(epoch) - 1])
            values = values[len(epoch):]
            infos = self._deepest_chain(tokens, order, keys, values[:len(order)], salt_key)
            depth = infos[-1].start_position + infos[-1].num_tokens if infos else 0
            if not self.markers.announced_deeper(tokens, order, values[len(order):], depth):
                break
            if time.monotonic() >= deadline:
                self._count("lookup_waits_expired")
                break
            if not waited:
                waited = True
                self._count("lookups_waited")
            time.sleep(WAIT_POLL_S)
        self._count("lookups")
        self._trim(keep={info.key for info in infos})
        if values is not FAILED:
            self.read_maxmemory(keep={info.key for info in infos})
        return infos

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def counted(self, name: str) -> int:
        """One of stats()'s counts (lookups_waited, lookup_waits_expired, ...)."""
        with self._lock:
            return self._counts[name]

    def _deepest_chain(self, tokens: Sequence[int], order: list[int], keys: dict[int, bytes], values: list,
                       salt_key: bytes | None) -> list[SegmentInfo]:
        """The deepest chain ending in a snapshot among the entries read at the positions `order`, registered
        here; bad entries are counted and deleted."""
        found: dict[int, tuple[IndexEntry, str]] = {}  # end -> (entry, its Redis name), deepest probe first
        bad = []
        for p, value in zip(order, values, strict=True):
            try:
                entry = entry_at(value, p, tokens)
            except ValueError:
                entry = None
                bad.append(self.names.entry(keys[p]))
            if entry is not None:
                found.setdefault(entry.end, (entry, self.names.entry(keys[p])))
        infos = []
        for end in sorted(found, reverse=True):
            entry, name = found[end]
            if entry.has_snapshot:
                chain = chain_keys(tokens, entry.bounds, salt_key)
                if chain[-1] == entry.key:
                    infos = self._register_chain(tokens, entry.bounds, chain, {e: f[0] for e, f in found.items()},
                                                 salt_key)
                    break
                bad.append(name)  # bounds that do not lead to its key: garbage
        if bad:
            self._forget_entries(bad)
        return infos

    def _forget_entries(self, names: list[str]) -> None:
        """Count bad index entries and delete them from Redis (they are hints: nothing else refers to them)."""
        for _ in names:
            self._fault("bad_entry")
        self.redis.pipelined([("delete", name) for name in names])

    def _register_chain(self, tokens: Sequence[int], bounds: tuple[int, ...], chain: list[bytes],
                        found: dict[int, IndexEntry], salt_key: bytes | None) -> list[SegmentInfo]:
        h, infos, parent = canonical_hasher(salt_key), [], salt_key
        for i, (start, stop) in enumerate(pairwise(bounds)):
            h.update(_tokens_to_bytes(tokens[start:stop]))
            e = found.get(stop)
            ok = e is not None and e.key == chain[i]
            info = SegmentInfo(chain[i], parent, start, stop - start, ok and e.has_snapshot, ok and e.has_logits,
                               e.size_bytes if ok else 0, time.time())
            with self._lock:
                known = self._index.get(chain[i])
                if known is None or (info.has_snapshot and not known.info.has_snapshot):
                    self._index.add(KnownSegment(info, bounds[:i + 2], tuple(tokens[start:stop]), h.copy()))
                    self._counts["found"] += 1
                infos.append(self._index.get(chain[i]).info)
            parent = h.digest()
        return infos

