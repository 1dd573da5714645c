"""DiskTier: radix-tree nodes as disk segments, and the tree rebuilt from the segments at start-up.

A node [start, end) is written as one segment: its tokens, the KV pages of its page indices (whole
pages, as stored on the device), and the snapshot (with logits) at its end when it has one. Its
parent key is the canonical key of the path before it, segment_key(None, path[:start]), so a segment
names its prefix whatever node boundaries the writer had, and equal prefixes get equal keys across
requests, restarts and servers. A snapshot is only resumable from disk when every node above it is on
disk too, so `persist` writes the missing ancestors first.

The namespace is the compatibility digest (cairn/compat.py, computed by the engine): the model
weights' content digest, the architecture, dtypes, page size and format version. A segment of
another model is never read.
What this is not: the file format and store (segment.py, store.py) or the choice of what to
write when (the cache decides).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import Counter
from collections.abc import Iterator

import torch

from cairn.cache.disk.segment import ROOT_KEY, Segment, _tokens_to_bytes, segment_key
from cairn.cache.disk.store import DiskStore
from cairn.cache.tree.nodes import DiskRef, Node

log = logging.getLogger(__name__)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes | memoryview, meta: dict) -> torch.Tensor:
    """A tensor over `data` (no copy when it is a writable view, as segments read from disk are)."""
    dtype = getattr(torch, meta["dtype"].removeprefix("torch."))
    if not (isinstance(data, memoryview) and not data.readonly):
        data = bytearray(data)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(meta["shape"])


def _meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype), "shape": list(t.shape)}


@dataclasses.dataclass
class SnapshotTensors:
    """A snapshot read back from disk."""

    tensors: dict[str, torch.Tensor]  # as StatePool.read_slot names them
    logits: torch.Tensor | None


class DiskTier:
    name = "disk"

    def __init__(self, store: DiskStore, page_size: int, write_through: bool = True):
        self.store = store
        self.page_size = page_size
        self.write_through = write_through  # persist every finished request (else only host evictions)
        self.counters: Counter[str] = Counter()

    # ---- writing ----------------------------------------------------------------------------------

    def persist(self, path: list[Node], kv_pages: callable, snapshot_of: callable) -> int:
        """Write every node of `path` (root to node, in order) that has no disk copy; returns segments written.

        kv_pages(node) -> (k, v) tensors of the node's pages, or None when they cannot be read (a bad
        segment, which the store then reports); snapshot_of(node) -> (named state tensors, logits) or None.
        Stops at the first failed write (a later node would be unreachable without it).
        """
        written = 0
        for node, parent_key in self._prefix_keys(path):
            if node.disk is not None and (node.snapshot is None or node.snapshot.handle.disk is not None):
                continue
            kv = kv_pages(node)
            if kv is None:
                self.counters["write_unreadable"] += 1
                return written
            segment = self._segment(node, parent_key, kv, snapshot_of(node))
            if not self.store.put(segment):
                self.counters["write_failed"] += 1
                return written
            node.disk = DiskRef(segment.key, node.start, node.end)
            if segment.snapshot_bytes is not None:
                node.snapshot.handle.disk = segment.key
            written += 1
            self.counters["segments_written"] += 1
        return written

    @staticmethod
    def _prefix_keys(path: list[Node]) -> Iterator[tuple[Node, bytes | None]]:
        """(node, canonical key of the path before it) for each node of a root-to-node path."""
        h = hashlib.blake2b(ROOT_KEY, digest_size=32, person=b"cairn-segment")
        for node in path:
            yield node, (h.copy().digest() if node.start else None)
            h.update(_tokens_to_bytes(node.tokens))

    def _segment(self, node: Node, parent_key: bytes | None, kv, snapshot) -> Segment:
        k, v = kv
        kv_tensor = torch.stack([k, v])
        fields = dict(key=segment_key(parent_key, node.tokens), parent_key=parent_key, start_position=node.start,
                      tokens=node.tokens, kv_bytes=_to_bytes(kv_tensor), kv_meta=_meta(kv_tensor))
        if snapshot is not None:
            tensors, logits = snapshot
            conv, recurrent = tensors["conv"], tensors["recurrent"]
            fields.update(snapshot_bytes=_to_bytes(conv) + _to_bytes(recurrent),
                          snapshot_meta={"conv": _meta(conv), "recurrent": _meta(recurrent),
                                         "conv_bytes": conv.numel() * conv.element_size()})
            if logits is not None:
                fields.update(logits_bytes=_to_bytes(logits.float()), logits_meta=_meta(logits.float()))
        return Segment(**fields)

    # ---- reading ----------------------------------------------------------------------------------

    def read(self, key: bytes) -> Segment | None:
        """The verified segment, pinned while read; None (counted) when missing or bad."""
        if not self.store.pin(key):
            self.counters["read_missing"] += 1
            return None
        try:
            segment = self.store.get(key)
        finally:
            self.store.unpin(key)
        self.counters["read_ok" if segment is not None else "read_bad"] += 1
        return segment

    @staticmethod
    def kv_of(segment: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of the segment's pages: [layers, pages, page_size, kv_heads, head_dim] each."""
        kv = _from_bytes(segment.kv_bytes, segment.kv_meta)
        return kv[0], kv[1]

    @staticmethod
    def snapshot_of(segment: Segment) -> SnapshotTensors | None:
        if segment.snapshot_bytes is None:
            return None
        meta = segment.snapshot_meta
        cut = meta["conv_bytes"]
        logits = None if segment.logits_bytes is None else _from_bytes(segment.logits_bytes, segment.logits_meta)
        return SnapshotTensors({"conv": _from_bytes(segment.snapshot_bytes[:cut], meta["conv"]),
                                "recurrent": _from_bytes(segment.snapshot_bytes[cut:], meta["recurrent"])}, logits)

    # ---- start-up -----------------------------------------------------------------------------------

    def stored_paths(self) -> Iterator[tuple[tuple[int, ...], int, DiskRef, bool, bool]]:
        """(path tokens [0, end), start, ref, has_snapshot, has_logits) for every indexed segment whose
        prefix chain is complete, parents before children. Orphans (a missing parent) are counted."""
        infos = [self.store.info(k) for k in self.store.keys()]  # noqa: SIM118 (a store, not a dict)
        infos = sorted((i for i in infos if i is not None), key=lambda i: (i.start_position, i.key))
        wanted = Counter(i.parent_key for i in infos if i.parent_key is not None)
        paths: dict[bytes, tuple[int, ...]] = {}
        for info in infos:
            tokens = self.store.get_tokens(info.key)
            prefix = () if info.parent_key is None else paths.get(info.parent_key)
            if tokens is None or prefix is None or len(prefix) != info.start_position:
                self.counters["orphan_segments"] += 1
                continue
            path = prefix + tokens
            end_key = segment_key(None, path)
            if wanted[end_key]:
                paths[end_key] = path
            yield path, info.start_position, DiskRef(info.key, info.start_position, len(path)), \
                info.has_snapshot, info.has_logits
