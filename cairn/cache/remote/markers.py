"""Markers: a replica announces the segments its write-behind has yet to send, so that others wait for them.

Round robin sends a conversation's next turn to another replica as soon as the previous turn's last token
is out, while that turn's segments (tens of MB at real sizes) are still queued behind the request. A
*marker* is the index entry a queued segment with a snapshot will store (keys.py), plus `"w"`, the writer's
id, under `cairn:<namespace>:w:<the entry's canonical key>`:

    Markers(redis, names, writer_id, capacity)
      announce(entries)   queue the markers of one segment's entries; a thread of their own sets them (with
                          an expiry of MARKER_TTL_MS), so they never wait behind the queued writes.
                          Announce BEFORE queueing the segment's write: the writer flushes this thread
                          before deleting the markers, so a marker set after that would outlive the write
      withdraw(entries)   queue their deletion behind their setting (a write that was then not queued)
      unmark(entries)     the delete commands the writer appends to the segment's own pipeline
      announced_deeper(tokens, positions, values, depth)   whether a marker read at these positions of a
                          prompt, set by ANOTHER writer, announces a snapshot deeper than `depth`

The lookup (store.py) reads the markers with the entries in its one round trip and, when one announces a
deeper chain, probes again until it lands, the marker goes (written, failed, expired) or its wait is over.
Markers are hints, never data: nothing is loaded from them, and a malformed one is ignored (it expires).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from cairn.cache.remote.client import FAILED
from cairn.cache.remote.keys import IndexEntry, KeyNames, entry_at
from cairn.cache.remote.writer import WriteBehind

MARKER_TTL_MS = 10_000  # a writer that died (or fell this far behind) is not waited for longer


def encode_marker(entry: IndexEntry, writer: str) -> bytes:
    raw = json.loads(entry.encode())
    raw["w"] = writer
    return json.dumps(raw, separators=(",", ":")).encode()


def marker_writer(data: bytes) -> str | None:
    """The writer id of a marker (None when malformed)."""
    try:
        writer = json.loads(data).get("w")
    except (ValueError, AttributeError):
        return None
    return writer if isinstance(writer, str) else None


class Markers:
    def __init__(self, redis, names: KeyNames, writer_id: str, capacity: int, on_fault: Callable[[str], None]):
        self.redis, self.names, self.writer_id = redis, names, writer_id
        self.num_set = 0
        self._thread = WriteBehind(self._send, lambda _: on_fault("mark_failed"), capacity, "cairn-remote-marker")

    def announce(self, entries: Sequence[tuple[bytes, IndexEntry]]) -> bool:
        marks = [("setpx", self.names.marker(k), encode_marker(e, self.writer_id), MARKER_TTL_MS) for k, e in entries]
        return self._thread.submit(("set", marks))

    def withdraw(self, entries: Sequence[tuple[bytes, IndexEntry]]) -> None:
        self._thread.submit(("unset", self.unmark(entries)))  # refused when full: they expire

    def _send(self, job: tuple[str, list[tuple]]) -> None:
        kind, commands = job
        if self.redis.pipelined(commands) is not FAILED and kind == "set":
            self.num_set += 1

    def unmark(self, entries: Sequence[tuple[bytes, IndexEntry]]) -> list[tuple]:
        return [("delete", self.names.marker(k)) for k, _ in entries]

    def announced_deeper(self, tokens: Sequence[int], positions: Sequence[int], values: list, depth: int) -> bool:
        for p, value in zip(positions, values, strict=True):
            if value is None or marker_writer(value) in (None, self.writer_id):
                continue
            try:
                entry = entry_at(value, p, tokens)
            except ValueError:
                continue
            if entry is not None and entry.has_snapshot and entry.end > depth:
                return True
        return False

    def flush(self, timeout_s: float) -> bool:
        return self._thread.flush(timeout_s)

    def close(self, timeout_s: float) -> None:
        self._thread.close(timeout_s)
