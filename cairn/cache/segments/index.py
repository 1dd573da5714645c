"""DiskIndex: the radix tree's record of a segment tier's segments (the disk's, or Redis's), kept in step with
its store.

    index()        hang every stored segment whose prefix chain is complete on the tree (start-up, and
                   after a rescan): nodes whose KV is on disk, snapshots whose copy is on disk
    mark_bad(key)  the cache found this segment unreadable (truncated, bit-flipped, a link, an I/O error...)
    mark_gone(key) the cache found this segment gone from its store (evicted, expired, its file deleted):
                   forgotten as evicted, and hung again when a rescan or lookup finds it written again
    forget()       drop the tree's references to segments that left the store (budget eviction, a bad
                   file the store found, a key marked bad); a node or snapshot still locked by a running
                   request keeps its record until a later forget(), and `usable` says not to resume
                   through it meanwhile
    relink()       a segment found bad and written again since (a request recomputed it): the segments
                   below it on disk, unreachable meanwhile, are hung again
    hang_found()   what a store shared with other writers found for a prompt (the remote tier's lookup,
                   run off the engine thread) is hung on the tree at admission
    rescan()       a read-only store (another server writes the namespace) is rescanned when a prompt
                   misses, at most every `rescan_interval_s`, so segments the writer adds later are
                   resumable here too

Every segment forgotten is counted by reason in `forgotten` (exported as the tier's metric,
cairn_cache_{disk,remote}_segments_forgotten_total{reason}): "<tier>_evicted" (the store let the segment go:
its budget, a bad file it found itself, a value found gone) or "<tier>_unreadable" (the cache could not read
a segment it planned to resume from), <tier> the tier's name ("disk_evicted", "remote_evicted"). What this is not:
the store (disk/store.py, remote/store.py), the segment format, or the tier moves (tiers/tier_set.py); it moves
no bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from cairn.cache.segments.tier import SegmentTier
from cairn.cache.tree.nodes import Node, SnapshotEntry
from cairn.cache.tree.tiered import TieredRadixTree

log = logging.getLogger(__name__)

MAX_UNREADABLE = 4096  # keys remembered as unreadable (then forgotten all at once)
RESCAN_INTERVAL_S = 2.0  # a read-only store rescans its directory at most this often, on a miss


class DiskIndex:
    def __init__(self, tree: TieredRadixTree, disk: SegmentTier, snapshot_bytes: Callable[[bool], int],
                 make_handle: Callable[[bool, bytes], object], rescan_interval_s: float = RESCAN_INTERVAL_S):
        self.tree, self.disk = tree, disk
        self.tier = disk  # the segment tier this index follows: its copies are keyed by disk.name
        self._snapshot_bytes, self._make_handle = snapshot_bytes, make_handle
        self.rescan_interval_s = rescan_interval_s
        self.forgotten: Counter[str] = Counter()  # segments whose references were dropped, by reason
        self._evicted_reason = f"{disk.name}_evicted"  # the store let the segment go (budget, a bad file it found)
        self._unreadable_reason = f"{disk.name}_unreadable"  # the cache could not read a segment it planned on
        self._gone: dict[bytes, str] = {}  # key -> reason: references to drop at the next forget()
        self._unreadable: set[bytes] = set()  # keys marked bad: a lookup never hangs them again
        self._rewritten: set[bytes] = set()  # keys marked bad that a request has written again since
        self._last_scan_s = time.monotonic()
        self._gone_lock = threading.Lock()  # a remote store reports failed writes from its writer thread
        disk.store.on_evict = self._evicted
        disk.on_written = self._written

    # ---- start-up and rescans -------------------------------------------------------------------

    def index(self) -> int:
        """Hang the store's segments on the tree (idempotent); returns the snapshots newly hung."""
        return self._hang(self.disk.stored_paths())

    def hang_found(self, found) -> bool:
        """Hang what a lookup by prompt found in a store shared with other writers (the remote tier, which
        holds more than this process indexed at start-up): (path, start, ref, has_snapshot, has_logits, salt key)
        segments, parents first, stopping at one found unreadable before. True when it hung any (match
        again: nodes may have been split). No I/O: the lookup ran elsewhere (cache/remote/lookups.py)."""
        usable = []
        for entry in found:
            if entry[2].key in self._unreadable or not self.usable(entry[2].key):
                break
            usable.append(entry)
        self._hang(usable)
        return bool(usable)

    def _hang(self, stored) -> int:
        """Hang (path, start, ref, has_snapshot, has_logits, salt key) segments, parents first, each under its salt's
        root; the snapshots newly hung."""
        found = 0
        for path, start, ref, has_snapshot, has_logits, salt_key in stored:
            node = self.tree.insert_from_segment(self.disk.name, path, start, ref, salt_key)
            if has_snapshot:
                found += self._hang_snapshot(node, ref.key, has_logits)
        return found

    def _hang_snapshot(self, node: Node, key: bytes, has_logits: bool) -> int:
        if node.snapshot is not None:  # already held (on the device, say): record the disk copy too
            copies = node.snapshot.handle.copies
            if self.disk.name not in copies and node.snapshot.has_logits == has_logits:
                copies[self.disk.name] = key
            return 0
        entry = SnapshotEntry(self._snapshot_bytes(has_logits), self.disk.name, has_logits,  # "disk", "remote"
                              self._make_handle(has_logits, key))
        self.tree.put_snapshot(node, entry)
        return 1

    def rescan(self) -> bool:
        """Re-read a read-only store's directory if the interval has passed; True when it hung new snapshots
        or segments on the tree (then match again). First the store takes the lock if its holder is gone (then
        it writes from now on, and this scan is the lock holder's)."""
        store = self.disk.store
        if not store.readonly or time.monotonic() - self._last_scan_s < self.rescan_interval_s:
            return False
        self._last_scan_s = time.monotonic()
        store.take_over()
        before = set(store.keys())
        store.scan()
        self.forget()
        if set(store.keys()) <= before:
            return False
        found = self.index()
        log.info("disk cache: rescan found %d new segments, %d new snapshots", len(set(store.keys()) - before), found)
        return True

    # ---- bad and evicted segments ---------------------------------------------------------------

    def _evicted(self, key: bytes) -> None:
        with self._gone_lock:
            self._gone.setdefault(key, self._evicted_reason)

    def _written(self, key: bytes) -> None:
        if key in self._unreadable:
            self._rewritten.add(key)

    def mark_bad(self, key: bytes) -> None:
        self._gone[key] = self._unreadable_reason
        if len(self._unreadable) >= MAX_UNREADABLE:
            self._unreadable.clear()
        self._unreadable.add(key)  # a lookup does not hang it again (its index entries may outlive it)

    def mark_gone(self, key: bytes) -> None:
        self._evicted(key)  # not remembered as unreadable: a value written again under its key is good

    def relink(self) -> int:
        """Hang again what lies below each segment marked bad and since written again (its key is back in the
        store): its descendants, which forget() dropped with it; returns the snapshots hung. A remote tier's
        come back through its lookups once the key is no longer remembered as unreadable."""
        if not self._rewritten:
            return 0
        back, self._rewritten = self._rewritten - self._gone.keys(), set()
        self._unreadable.difference_update(back)
        if not back or not self.disk.relinks_below:
            return 0
        name, found = self.disk.name, 0
        for node in [n for n in self.tree.iter_nodes() if name in n.kv and n.kv[name].key in back]:
            if node.parent is not None and node.end == node.kv[name].segment_end:
                found += self._hang(self.disk.paths_below(*_path_of(node)))
        if found:
            log.info("%s cache: %d snapshots below %d rewritten segments are resumable again", name, found, len(back))
        return found

    def usable(self, key: bytes | None) -> bool:
        """The segment may be read (it is not waiting to be forgotten)."""
        return key is not None and key not in self._gone

    def forget(self) -> None:
        """Drop the tree's references to the segments that left the store, except what is locked."""
        if not self._gone:
            return
        with self._gone_lock:
            gone, self._gone = self._gone, {}
        name = self.disk.name
        for _, entry, node in list(self.tree.iter_snapshots()):
            copies = entry.handle.copies
            key = copies.get(name)
            if key not in gone:
                continue
            if len(copies) > 1:
                del copies[name]  # faster copies remain
            elif entry.lock_count == 0:
                del copies[name]
                self.tree.remove_snapshot(node, gone[key])
            else:
                self._gone[key] = gone[key]  # a running request holds it: forget later
        for node in [n for n in self.tree.iter_nodes() if name in n.kv and n.kv[name].key in gone]:
            if node.parent is None:  # left the tree with an ancestor above
                continue
            key = node.kv[name].key
            if node.lock_count:
                self._gone[key] = gone[key]
                continue
            self.tree.drop_kv(node, name)
        self.forgotten.update(reason for key, reason in gone.items() if key not in self._gone)


def _path_of(node: Node) -> tuple[tuple[int, ...], bytes | None]:
    """The tokens of the path from its root to node's end, and that root's salt key."""
    runs = []
    while node.parent is not None:
        runs.append(tuple(node.tokens))
        node = node.parent
    return tuple(t for run in reversed(runs) for t in run), node.salt_key
