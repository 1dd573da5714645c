"""Names and small index entries of the remote tier, and the canonical keys of a prompt's prefixes.

A segment is stored under `cairn:<namespace>:s:<segment key hex>` with its exact disk-format bytes
(segment.py). A replica that never saw a conversation does not know where the writer's node
boundaries were, so beside each segment the writer stores a small *index entry* keyed by the
canonical key of the path up to the segment's END, `cairn:<namespace>:e:<segment_key(root, path[:end]) hex>`
(root: the path's salt key, None without a cache salt; segment.salt_key):

    {"v": 1, "key": <segment key hex>, "bounds": [0, b1, ..., end], "tail": [],
     "snap": bool, "logits": bool, "size": <bytes>}

`bounds` are the start positions of every segment of the chain and its end: from a prompt's tokens the
reader recomputes each segment key of the chain (segment_key(canonical(path[:b_i]), path[b_i:b_i+1])),
so one pipelined GET of the whole chain follows one probe. When `end` is not a multiple of the page
size, a second copy of the entry sits at the page-aligned position below it, with the tokens from
there to the end in `tail`: a prompt probes only page multiples, message starts and its own end, and
still finds a snapshot taken at an odd position (the tail is checked against the prompt).

Beside them, markers announce segments still being written (markers.py), under
`cairn:<namespace>:w:<same canonical key>`.

Entries are hints, never trusted: every key they lead to is recomputed from the prompt's own tokens,
and every segment read is fully verified (checksums, version, namespace) by segment.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from cairn.cache.segments.segment import KEY_BYTES, Segment, _tokens_to_bytes, path_hasher, segment_key

ENTRY_VERSION = 1
MAX_ENTRY_BYTES = 1 << 20  # an entry larger than this is refused as malformed


def canonical_hasher(salt_key: bytes | None = None):
    """The running hash whose digest after tokens[:p] is segment_key(salt_key, tokens[:p])."""
    return path_hasher(salt_key)


def prefix_keys(tokens: Sequence[int], positions: Iterable[int], salt_key: bytes | None = None) -> dict[int, bytes]:
    """{p: segment_key(salt_key, tokens[:p])} for each position 0 < p <= len(tokens), in one pass over tokens."""
    h, done, out = canonical_hasher(salt_key), 0, {}
    for p in sorted({p for p in positions if 0 < p <= len(tokens)}):
        h.update(_tokens_to_bytes(tokens[done:p]))
        done = p
        out[p] = h.digest()
    return out


def chain_keys(tokens: Sequence[int], bounds: Sequence[int], salt_key: bytes | None = None) -> list[bytes]:
    """The segment keys of a chain cut at `bounds` ([0, b1, ..., end]) over tokens, chained from salt_key's root:
    one per segment."""
    parents = prefix_keys(tokens, bounds[1:-1], salt_key)
    return [segment_key(parents[start] if start else salt_key, tokens[start:stop]) for start, stop in pairwise(bounds)]


@dataclass(frozen=True)
class IndexEntry:
    """Where a chain of segments ends, as stored beside it (see the module docstring)."""

    key: bytes  # the last segment's key
    bounds: tuple[int, ...]  # 0, each later segment's start, the chain's end
    tail: tuple[int, ...]  # tokens from the entry's (page-aligned) position to the end; () at the end itself
    has_snapshot: bool  # the last segment holds a snapshot at the end
    has_logits: bool  # ... and the logits at end - 1
    size_bytes: int  # the last segment's stored bytes

    @property
    def end(self) -> int:
        return self.bounds[-1]

    def encode(self) -> bytes:
        return json.dumps({"v": ENTRY_VERSION, "key": self.key.hex(), "bounds": list(self.bounds),
                           "tail": list(self.tail), "snap": self.has_snapshot, "logits": self.has_logits,
                           "size": self.size_bytes}, separators=(",", ":")).encode()


def index_entries(segment: Segment, bounds: tuple[int, ...], start_hash, end_hash, page_size: int
                  ) -> tuple[tuple[bytes, IndexEntry], ...]:
    """(canonical key of the entry's position, entry without its size) for each index entry of a segment that ends
    a chain cut at `bounds`: at its end, and at the page-aligned position below it when that is inside the
    segment, with the tokens from there to the end (the module docstring). start_hash, end_hash: canonical_hasher()
    after the path before the segment and after the whole path (neither is changed)."""
    entry = IndexEntry(segment.key, bounds, (), segment.snapshot_bytes is not None,
                       segment.logits_bytes is not None, 0)
    out = [(end_hash.digest(), entry)]
    aligned = segment.end_position // page_size * page_size
    if segment.start_position < aligned < segment.end_position:
        cut = aligned - segment.start_position
        h = start_hash.copy()
        h.update(_tokens_to_bytes(segment.tokens[:cut]))
        out.append((h.digest(), IndexEntry(segment.key, bounds, segment.tokens[cut:], entry.has_snapshot,
                                           entry.has_logits, 0)))
    return tuple(out)


def decode_entry(data: bytes) -> IndexEntry:
    """Parse an entry; ValueError when it is not one this build writes (another version, malformed)."""
    if len(data) > MAX_ENTRY_BYTES:
        raise ValueError("index entry too large")
    try:
        raw = json.loads(data)
        if raw["v"] != ENTRY_VERSION:
            raise ValueError(f"index entry version {raw['v']}")
        entry = IndexEntry(bytes.fromhex(raw["key"]), tuple(int(b) for b in raw["bounds"]),
                           tuple(int(t) for t in raw["tail"]), bool(raw["snap"]), bool(raw["logits"]),
                           int(raw["size"]))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed index entry: {e}") from None
    b = entry.bounds
    if len(entry.key) != KEY_BYTES or len(b) < 2 or b[0] != 0 or any(x >= y for x, y in pairwise(b)):
        raise ValueError("malformed index entry: bad key or bounds")
    return entry


def entry_at(value: bytes | None, position: int, tokens: Sequence[int]) -> IndexEntry | None:
    """The entry read at the canonical key of tokens[:position], when it describes a chain of this prompt
    (its tail matches the prompt); None when absent or another branch's; ValueError when malformed."""
    if value is None:
        return None
    entry = decode_entry(value)
    end = position + len(entry.tail)
    if entry.end != end or end > len(tokens) or tuple(tokens[position:end]) != entry.tail:
        return None  # another branch's tail at this aligned position: not ours, not bad
    return entry


@dataclass(frozen=True)
class KeyNames:
    """The Redis key names of one namespace (the compatibility digest)."""

    namespace: str

    def segment(self, key: bytes) -> str:
        return f"cairn:{self.namespace}:s:{key.hex()}"

    def entry(self, end_key: bytes) -> str:
        return f"cairn:{self.namespace}:e:{end_key.hex()}"

    def marker(self, end_key: bytes) -> str:
        return f"cairn:{self.namespace}:w:{end_key.hex()}"

    def epoch(self) -> str:
        return f"cairn:{self.namespace}:epoch"
