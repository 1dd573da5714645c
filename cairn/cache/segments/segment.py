"""The segment format (a disk file and a Redis value are the same bytes): its layout, keys, and encode (the
strict decode is decode.py's).

A segment is one node of the radix tree of token sequences, as bytes: its tokens, the KV pages of
those tokens, and optionally the recurrent-state snapshot and logits at its end. Its key chains its
parent's key with its tokens, so equal prefixes get equal keys across requests, restarts and servers.

This module is NOT a store (disk/store.py names, writes, indexes and evicts files; remote/store.py holds them
in Redis), nor the reading back of a file (decode.py: every check a file must pass before it is loaded), and knows
nothing of tensors: KV, snapshot and logits are bytes whose shapes and dtypes travel in small JSON
dicts chosen by the caller. The snapshot's dict is the one checked: it names the tensors the section
holds back to back, with dtype, shape and offset (named_bytes.py), whatever the model's state spec.

File layout (little-endian; every length is checked against `SegmentLimits` before allocating):

    offset  size  field
    0       8     magic b"CAIRNSEG"
    8       2     format version (u16, FORMAT_VERSION)
    10      1     codec (u8: 0 none, 1 zstd, 2 lz4) of the sections flagged compressed
    11      1     digest_len (u8, 1..64): bytes of the compatibility digest
    12      4     flags (u32, FLAG_*)
    16      64    compatibility digest, zero padded
    80      32    key
    112     32    parent key (zeros when FLAG_HAS_PARENT is clear)
    144     8     start position (u64)
    152     4     token count (u32, >= 1)
    156     8     file_bytes (u64): the whole file's size
    164     16    header checksum: XXH3-128 of bytes [0, 164)
    180     ...   sections, in this order: tokens, kv, snapshot?, logits?, meta; each is
                    id (u32) | stored_bytes (u64) | raw_bytes (u64) | checksum (16) | payload
                  where checksum = XXH3-128(id | stored_bytes | raw_bytes | payload), over the
                  stored (possibly compressed) payload
    end-32  8     end magic b"CAIRNEND"
    end-24  8     file_bytes again (u64)
    end-16  16    sections digest: XXH3-128(header checksum | every section checksum)

The checksums detect damage (a torn write, a flipped bit, a truncated copy), not tampering: none is keyed,
so whoever can write the directory can also recompute them (as with any unkeyed hash). XXH3-128 runs at
memory speed (about 10x SHA-256 with SHA-NI here), so verifying a restore costs little beside reading it.
The content address (`segment_key`) stays a cryptographic hash: equal keys must mean equal tokens.

Tokens are uint32 little-endian; the meta section is JSON {"kv": {...}, "snapshot": {"tensors": [...]},
"logits": {...}}, never compressed.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from cairn.cache.segments.named_bytes import read_layout

# 2: sha256 section checksums (1 used blake2b); 3: the snapshot section is a list of named tensors (2 held a
# fixed conv / recurrent pair); 4: XXH3-128 checksums (3 used sha256[:16], which cost more than reading the
# file). Older files are refused as 'version' (and live in another namespace).
FORMAT_VERSION = 4
MAGIC = b"CAIRNSEG"
END_MAGIC = b"CAIRNEND"
KEY_BYTES = 32
MAX_DIGEST_BYTES = 64
ROOT_KEY = hashlib.blake2b(b"cairn.segment.root", digest_size=KEY_BYTES).digest()  # parent of depth-1 segments

FLAG_HAS_PARENT = 1 << 0
FLAG_HAS_SNAPSHOT = 1 << 1
FLAG_HAS_LOGITS = 1 << 2
FLAG_KV_COMPRESSED = 1 << 3
FLAG_SNAPSHOT_COMPRESSED = 1 << 4
FLAG_LOGITS_COMPRESSED = 1 << 5
KNOWN_FLAGS = (1 << 6) - 1

SECTION_TOKENS, SECTION_KV, SECTION_SNAPSHOT, SECTION_LOGITS, SECTION_META = 1, 2, 3, 4, 5
CODECS = {None: 0, "zstd": 1, "lz4": 2}

HEADER_STRUCT = struct.Struct("<8sHBBI64s32s32sQIQ")  # everything before the header checksum
SECTION_STRUCT = struct.Struct("<IQQ")
END_STRUCT = struct.Struct("<8sQ16s")
_CHECKSUM_BYTES = 16
HEADER_BYTES = HEADER_STRUCT.size + _CHECKSUM_BYTES  # 180
SECTION_HEADER_BYTES = SECTION_STRUCT.size + _CHECKSUM_BYTES  # 36
END_BYTES = END_STRUCT.size  # 32

REASONS = frozenset({"truncated", "checksum", "version", "magic", "foreign_model", "oversized", "malformed", "empty"})


class SegmentError(Exception):
    """A segment that must not be loaded; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message  # message: what is wrong, without the reason


@dataclass(frozen=True)
class SegmentLimits:
    """Upper bounds checked before any allocation when reading (and when writing) a segment."""

    max_file_bytes: int = 8 << 30  # whole file, on disk
    max_section_bytes: int = 8 << 30  # one section after decompression
    max_tokens: int = 1 << 22  # tokens in one segment
    max_meta_bytes: int = 1 << 20  # the meta JSON section


DEFAULT_LIMITS = SegmentLimits()


@dataclass(frozen=True)
class Segment:
    """One radix-tree node's cached content, as bytes. `tokens` is normalised to a tuple."""

    key: bytes  # segment_key(parent_key, tokens): 32 bytes
    parent_key: bytes | None  # the parent node's key (32 bytes); None for a child of the root
    start_position: int  # absolute position of tokens[0]; the node covers [start, start + len(tokens))
    tokens: tuple[int, ...]  # token ids, each < 2**32, at least one
    kv_bytes: bytes  # opaque KV pages of these tokens
    kv_meta: dict = field(default_factory=dict)  # JSON-able shapes/dtypes/page size of kv_bytes
    snapshot_bytes: bytes | None = None  # opaque recurrent-state snapshot at position end, or None
    snapshot_meta: dict = field(default_factory=dict)  # its tensors (named_bytes.layout_meta); {} without one
    logits_bytes: bytes | None = None  # opaque logits at position end - 1, or None
    logits_meta: dict = field(default_factory=dict)  # JSON-able description of logits_bytes

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(self.tokens))

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.tokens)


@dataclass(frozen=True)
class SegmentHeader:
    """What the fixed-size header says; enough to index a file without reading its sections."""

    key: bytes  # 32 bytes
    parent_key: bytes | None  # None for a child of the root
    start_position: int  # absolute position of the first token
    num_tokens: int  # tokens in the segment
    has_snapshot: bool  # a snapshot section is present
    has_logits: bool  # a logits section is present
    flags: int  # FLAG_* bits
    codec: int  # CODECS value used by sections flagged compressed
    file_bytes: int  # size of the whole file


def checksum(*parts) -> bytes:
    """XXH3-128 of the parts, in order (16 bytes): catches damage as surely as a truncated SHA-256 would, at
    memory speed, which matters for the megabyte sections verified on every restore."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


def _tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    try:
        arr = array("I", tokens)
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    assert arr.itemsize == 4
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def tokens_from_bytes(data) -> tuple[int, ...]:
    arr = array("I")
    arr.frombytes(data)
    if sys.byteorder == "big":
        arr.byteswap()
    return tuple(arr)


def segment_key(parent_key: bytes | None, tokens: Sequence[int]) -> bytes:
    """32-byte content address of a node: blake2b-256(parent key or ROOT_KEY | tokens as LE uint32).

    Deterministic across processes and machines, so equal prefixes cut into equal segments get
    equal keys. Raises ValueError on a parent key that is not 32 bytes or a token outside uint32.
    """
    parent = ROOT_KEY if parent_key is None else bytes(parent_key)
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    return hashlib.blake2b(parent + _tokens_to_bytes(tokens), digest_size=KEY_BYTES, person=b"cairn-segment").digest()


def salt_key_of(cache_salt: str | None) -> bytes | None:
    """The root a cache salt's chains hang from, in place of ROOT_KEY (None without a salt: today's keys).

    Every content address chains from its path's root: a salted path's first segment names this key as its
    parent (a segment at position 0 with a parent key), and each canonical key of its prefixes hashes this key
    where an unsalted one hashes ROOT_KEY. So no key of one salt equals a key of another, or of no salt, in any
    tier (DESIGN invariant 8). A keyed hash: the salt itself is written nowhere."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), key=ROOT_KEY, digest_size=KEY_BYTES,
                           person=b"cairn-salt").digest()


def path_hasher(root: bytes | None = None):
    """The running hash whose digest after path[:p] is segment_key(root, path[:p]): the canonical key of a prefix
    of a path chained from `root` (a salt_key; None: ROOT_KEY)."""
    return hashlib.blake2b(ROOT_KEY if root is None else root, digest_size=KEY_BYTES, person=b"cairn-segment")


def digest_bytes(compat_digest: str) -> bytes:
    """The compatibility digest (a hex string) as raw bytes; ValueError if it is not 1..64 bytes of hex."""
    try:
        raw = bytes.fromhex(compat_digest)
    except (ValueError, TypeError):
        raise ValueError(f"compat_digest must be a hex string, got {compat_digest!r}") from None
    if not 1 <= len(raw) <= MAX_DIGEST_BYTES or compat_digest != raw.hex():
        raise ValueError(f"compat_digest must be 2..{2 * MAX_DIGEST_BYTES} lowercase hex digits")
    return raw


# ---------------------------------------------------------------------------------------------- codecs


def _codec_module(codec: int):
    """The compression module for a codec id (zstd or lz4: the only ids a file passing the header check or an
    encoder's codec can hold); None when it is not installed."""
    try:
        if codec == CODECS["zstd"]:
            import zstandard

            return zstandard
        import lz4.block

        return lz4.block
    except ImportError:
        return None


def _compress(codec: int, data) -> bytes:
    mod = _codec_module(codec)
    if mod is None:
        raise ValueError(f"compression codec {codec} is not installed")
    if codec == CODECS["zstd"]:
        return mod.ZstdCompressor(level=1, write_content_size=True).compress(data)
    return mod.compress(data, store_size=False)


def decompress(codec: int, data, raw_bytes: int) -> bytes:
    """Decompress into exactly raw_bytes (already bounded by the caller), never more."""
    mod = _codec_module(codec)
    if mod is None:
        raise SegmentError("version", f"codec {codec} is not available in this build")
    try:
        if codec == CODECS["zstd"]:
            if mod.frame_content_size(data) != raw_bytes:
                raise SegmentError("malformed", "zstd frame size differs from the section's raw size")
            out = mod.ZstdDecompressor().decompress(data, max_output_size=raw_bytes)
        else:
            out = mod.decompress(data, uncompressed_size=raw_bytes)
    except SegmentError:
        raise
    except Exception as e:  # each codec raises its own error type on corrupt input
        raise SegmentError("malformed", f"decompression failed: {e}") from None
    if len(out) != raw_bytes:
        raise SegmentError("malformed", "decompressed size differs from the section's raw size")
    return out


# ---------------------------------------------------------------------------------------------- encode


def _byte_view(blob) -> memoryview:
    view = memoryview(blob)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _check_segment(segment: Segment, limits: SegmentLimits) -> None:
    """ValueError when the segment is inconsistent; SegmentError("oversized") when it exceeds limits."""
    if segment.parent_key is not None and len(segment.parent_key) != KEY_BYTES:
        raise ValueError(f"parent_key must be {KEY_BYTES} bytes")
    if not segment.tokens:
        raise ValueError("a segment holds at least one token")
    if len(segment.tokens) > limits.max_tokens:
        raise SegmentError("oversized", f"{len(segment.tokens)} tokens > max_tokens {limits.max_tokens}")
    if not 0 <= segment.start_position < 1 << 63:
        raise ValueError(f"start_position out of range: {segment.start_position}")
    if segment.key != segment_key(segment.parent_key, segment.tokens):
        raise ValueError("segment.key is not segment_key(parent_key, tokens)")
    if segment.snapshot_bytes is not None:
        read_layout(segment.snapshot_meta, _byte_view(segment.snapshot_bytes).nbytes)  # LayoutError is a ValueError


def _meta_bytes(segment: Segment, limits: SegmentLimits) -> bytes:
    meta = {"kv": segment.kv_meta, "snapshot": segment.snapshot_meta, "logits": segment.logits_meta}
    if not all(isinstance(m, dict) for m in meta.values()):
        raise ValueError("kv_meta, snapshot_meta and logits_meta must be dicts")
    try:
        data = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"segment meta is not JSON-serialisable: {e}") from None
    if len(data) > limits.max_meta_bytes:
        raise SegmentError("oversized", f"meta JSON of {len(data)} bytes > max_meta_bytes {limits.max_meta_bytes}")
    return data


def _planned_sections(segment: Segment, limits: SegmentLimits) -> list[tuple[int, memoryview, int]]:
    """(section id, raw payload, the flag set when it is stored compressed; 0 = never compressed)."""
    sections = [(SECTION_TOKENS, _byte_view(_tokens_to_bytes(segment.tokens)), 0),
                (SECTION_KV, _byte_view(segment.kv_bytes), FLAG_KV_COMPRESSED)]
    if segment.snapshot_bytes is not None:
        sections.append((SECTION_SNAPSHOT, _byte_view(segment.snapshot_bytes), FLAG_SNAPSHOT_COMPRESSED))
    if segment.logits_bytes is not None:
        sections.append((SECTION_LOGITS, _byte_view(segment.logits_bytes), FLAG_LOGITS_COMPRESSED))
    sections.append((SECTION_META, _byte_view(_meta_bytes(segment, limits)), 0))
    for _, raw, _ in sections:
        if raw.nbytes > limits.max_section_bytes:
            raise SegmentError("oversized", f"section of {raw.nbytes} bytes > max_section_bytes")
    return sections


def encode_segment_parts(segment: Segment, compat_digest: str, compression: str | None = None,
                         limits: SegmentLimits = DEFAULT_LIMITS) -> list:
    """The file's bytes as consecutive parts (header, section headers, payloads, end marker).

    Lets a writer stream large payloads without joining them. A section is stored compressed only
    when that makes it smaller. Raises ValueError on an inconsistent segment or unknown codec, and
    SegmentError("oversized") when the segment or file exceeds `limits`.
    """
    digest = digest_bytes(compat_digest)
    if compression not in CODECS:
        raise ValueError(f"compression must be one of {sorted(CODECS, key=str)}, got {compression!r}")
    _check_segment(segment, limits)
    codec = CODECS[compression]
    flags = (FLAG_HAS_PARENT * (segment.parent_key is not None)
             | FLAG_HAS_SNAPSHOT * (segment.snapshot_bytes is not None)
             | FLAG_HAS_LOGITS * (segment.logits_bytes is not None))
    body, section_sums = [], []
    for section_id, raw, compress_flag in _planned_sections(segment, limits):
        stored = raw
        if compress_flag and codec:
            packed = _compress(codec, raw)
            if len(packed) < raw.nbytes:
                stored, flags = packed, flags | compress_flag
        head = SECTION_STRUCT.pack(section_id, len(stored), raw.nbytes)
        section_sums.append(checksum(head, stored))
        body += [head + section_sums[-1], stored]
    file_bytes = HEADER_BYTES + sum(len(part) for part in body) + END_BYTES
    if file_bytes > limits.max_file_bytes:
        raise SegmentError("oversized", f"file of {file_bytes} bytes > max_file_bytes {limits.max_file_bytes}")
    head = HEADER_STRUCT.pack(MAGIC, FORMAT_VERSION, codec, len(digest), flags, digest, segment.key,
                        segment.parent_key or bytes(KEY_BYTES), segment.start_position, len(segment.tokens), file_bytes)
    header_sum = checksum(head)
    end = END_STRUCT.pack(END_MAGIC, file_bytes, checksum(header_sum, *section_sums))
    return [head + header_sum, *body, end]


def encode_segment(segment: Segment, compat_digest: str, compression: str | None = None,
                   limits: SegmentLimits = DEFAULT_LIMITS) -> bytes:
    """The whole segment file as one bytes object (see encode_segment_parts)."""
    return b"".join(encode_segment_parts(segment, compat_digest, compression, limits))
