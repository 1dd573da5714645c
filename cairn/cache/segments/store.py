"""What every segment store shares: SegmentInfo, what a store knows of a segment without reading it.

What this is not: a store (the disk's is cairn/cache/disk/store.py, Redis's cairn/cache/remote/store.py), nor
the segment format (segment.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SegmentInfo:
    """What the index knows about a stored segment, without reading its file."""

    key: bytes  # 32-byte segment key
    parent_key: bytes | None  # None for a child of the root
    start_position: int  # absolute position of the first token
    num_tokens: int  # tokens in the segment
    has_snapshot: bool  # holds a recurrent-state snapshot at start_position + num_tokens
    has_logits: bool  # holds the logits at start_position + num_tokens - 1
    size_bytes: int  # file size, counted against the budget
    last_used: float  # wall-clock seconds of the last get/put in this process (file mtime at scan)
