"""The disk tier's segment file format: keys, encode, and strict decode.

A segment is one node of the radix tree of token sequences, as bytes: its tokens, the KV pages of
those tokens, and optionally the recurrent-state snapshot and logits at its end. Its key chains its
parent's key with its tokens, so equal prefixes get equal keys across requests, restarts and servers.

This module is NOT the store (`store.py` names, writes, indexes and evicts files) and knows
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

from cairn.cache.disk.named_bytes import LayoutError, read_layout

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
_KNOWN_FLAGS = (1 << 6) - 1

SECTION_TOKENS, SECTION_KV, SECTION_SNAPSHOT, SECTION_LOGITS, SECTION_META = 1, 2, 3, 4, 5
CODECS = {None: 0, "zstd": 1, "lz4": 2}

_HEADER = struct.Struct("<8sHBBI64s32s32sQIQ")  # everything before the header checksum
_SECTION = struct.Struct("<IQQ")
_END = struct.Struct("<8sQ16s")
_CHECKSUM_BYTES = 16
HEADER_BYTES = _HEADER.size + _CHECKSUM_BYTES  # 180
SECTION_HEADER_BYTES = _SECTION.size + _CHECKSUM_BYTES  # 36
END_BYTES = _END.size  # 32

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


def _checksum(*parts) -> bytes:
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


def _tokens_from_bytes(data) -> tuple[int, ...]:
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


def _decompress(codec: int, data, raw_bytes: int) -> bytes:
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
        head = _SECTION.pack(section_id, len(stored), raw.nbytes)
        section_sums.append(_checksum(head, stored))
        body += [head + section_sums[-1], stored]
    file_bytes = HEADER_BYTES + sum(len(part) for part in body) + END_BYTES
    if file_bytes > limits.max_file_bytes:
        raise SegmentError("oversized", f"file of {file_bytes} bytes > max_file_bytes {limits.max_file_bytes}")
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, codec, len(digest), flags, digest, segment.key,
                        segment.parent_key or bytes(KEY_BYTES), segment.start_position, len(segment.tokens), file_bytes)
    header_sum = _checksum(head)
    end = _END.pack(END_MAGIC, file_bytes, _checksum(header_sum, *section_sums))
    return [head + header_sum, *body, end]


def encode_segment(segment: Segment, compat_digest: str, compression: str | None = None,
                   limits: SegmentLimits = DEFAULT_LIMITS) -> bytes:
    """The whole segment file as one bytes object (see encode_segment_parts)."""
    return b"".join(encode_segment_parts(segment, compat_digest, compression, limits))


# ---------------------------------------------------------------------------------------------- decode


def read_header(data, compat_digest: str, file_bytes: int, limits: SegmentLimits = DEFAULT_LIMITS) -> SegmentHeader:
    """Validate the first HEADER_BYTES of a file whose actual size is file_bytes.

    Checks, in order: empty, oversized size, magic, truncated header, version, header checksum,
    field consistency (malformed), compatibility digest (foreign_model), token count, and that the
    declared size equals the actual one (smaller: truncated, larger: malformed). Reads nothing else.
    """
    if file_bytes == 0:
        raise SegmentError("empty", "zero-length file")
    if file_bytes > limits.max_file_bytes:
        raise SegmentError("oversized", f"file of {file_bytes} bytes > max_file_bytes {limits.max_file_bytes}")
    data = bytes(data[:HEADER_BYTES])
    if not MAGIC.startswith(data[: len(MAGIC)]):
        raise SegmentError("magic", "not a cairn segment file")
    if len(data) < HEADER_BYTES or file_bytes < HEADER_BYTES:
        raise SegmentError("truncated", f"file of {file_bytes} bytes ends inside the header")
    fields = _HEADER.unpack_from(data)
    _, version, codec, digest_len, flags, digest, key, parent, start, num_tokens, declared_bytes = fields
    if version != FORMAT_VERSION:
        raise SegmentError("version", f"format version {version}, this build reads {FORMAT_VERSION}")
    if _checksum(data[: _HEADER.size]) != data[_HEADER.size :]:
        raise SegmentError("checksum", "header checksum mismatch")
    _check_header_fields(codec, digest_len, flags, digest, parent)
    if digest[:digest_len] != digest_bytes(compat_digest):
        raise SegmentError("foreign_model", f"written for model {digest[:digest_len].hex()[:16]}..")
    if num_tokens == 0 or declared_bytes < HEADER_BYTES + END_BYTES:
        raise SegmentError("malformed", "empty token range or impossible file size")
    if num_tokens > limits.max_tokens:
        raise SegmentError("oversized", f"{num_tokens} tokens > max_tokens {limits.max_tokens}")
    if file_bytes < declared_bytes:
        raise SegmentError("truncated", f"file has {file_bytes} of its {declared_bytes} bytes")
    if file_bytes > declared_bytes:
        raise SegmentError("malformed", f"file has {file_bytes - declared_bytes} trailing bytes")
    return SegmentHeader(key=key, parent_key=parent if flags & FLAG_HAS_PARENT else None, start_position=start,
                         num_tokens=num_tokens, has_snapshot=bool(flags & FLAG_HAS_SNAPSHOT),
                         has_logits=bool(flags & FLAG_HAS_LOGITS), flags=flags, codec=codec, file_bytes=declared_bytes)


def _check_header_fields(codec: int, digest_len: int, flags: int, digest: bytes, parent: bytes) -> None:
    compressed = FLAG_KV_COMPRESSED | FLAG_SNAPSHOT_COMPRESSED | FLAG_LOGITS_COMPRESSED
    if (codec not in CODECS.values() or flags & ~_KNOWN_FLAGS or (flags & compressed and codec == 0)
            or not 1 <= digest_len <= MAX_DIGEST_BYTES or any(digest[digest_len:])
            or (not flags & FLAG_HAS_PARENT and any(parent))):
        raise SegmentError("malformed", "inconsistent header fields")


def check_end_marker(data, header: SegmentHeader) -> bytes:
    """Validate the last END_BYTES of the file; returns the sections digest it records."""
    if len(data) != END_BYTES:
        raise SegmentError("truncated", "no end marker")
    magic, file_bytes, sections_digest = _END.unpack(bytes(data))
    if magic != END_MAGIC or file_bytes != header.file_bytes:
        raise SegmentError("malformed", "end marker does not match the header")
    return sections_digest


def _expected_sections(header: SegmentHeader) -> list[tuple[int, int]]:
    expected = [(SECTION_TOKENS, 0), (SECTION_KV, FLAG_KV_COMPRESSED)]
    if header.has_snapshot:
        expected.append((SECTION_SNAPSHOT, FLAG_SNAPSHOT_COMPRESSED))
    if header.has_logits:
        expected.append((SECTION_LOGITS, FLAG_LOGITS_COMPRESSED))
    return expected + [(SECTION_META, 0)]


def _read_sections(view: memoryview, header: SegmentHeader, limits: SegmentLimits) -> tuple[dict, list[bytes]]:
    """{section id: raw payload} and the section checksums, each section bounded and verified."""
    payloads, sums = {}, []
    offset, end = HEADER_BYTES, header.file_bytes - END_BYTES
    for section_id, compress_flag in _expected_sections(header):
        if end - offset < SECTION_HEADER_BYTES:
            raise SegmentError("malformed", f"section {section_id} header runs past the end marker")
        got_id, stored_bytes, raw_bytes = _SECTION.unpack_from(view, offset)
        body = offset + SECTION_HEADER_BYTES
        if got_id != section_id or stored_bytes > end - body:
            raise SegmentError("malformed", f"section {section_id}: unexpected id {got_id} or length {stored_bytes}")
        if raw_bytes > limits.max_section_bytes:
            raise SegmentError("oversized", f"section {section_id} of {raw_bytes} bytes > max_section_bytes")
        stored = view[body : body + stored_bytes]
        sums.append(bytes(view[offset + _SECTION.size : body]))
        if _checksum(view[offset : offset + _SECTION.size], stored) != sums[-1]:
            raise SegmentError("checksum", f"section {section_id} checksum mismatch")
        if header.flags & compress_flag:
            payloads[section_id] = _decompress(header.codec, stored, raw_bytes)
        elif stored_bytes != raw_bytes:
            raise SegmentError("malformed", f"section {section_id}: stored and raw sizes differ")
        else:
            # a view, not a copy: KV and snapshot sections are megabytes (valid while the caller's buffer is)
            payloads[section_id] = stored if section_id in (SECTION_KV, SECTION_SNAPSHOT, SECTION_LOGITS) \
                else bytes(stored)
        offset = body + stored_bytes
    if offset != end:
        raise SegmentError("malformed", "bytes between the last section and the end marker")
    return payloads, sums


def _parse_meta(data: bytes, limits: SegmentLimits) -> dict:
    if len(data) > limits.max_meta_bytes:
        raise SegmentError("oversized", f"meta JSON of {len(data)} bytes > max_meta_bytes")
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError):
        raise SegmentError("malformed", "meta section is not JSON") from None
    if not isinstance(meta, dict) or set(meta) != {"kv", "snapshot", "logits"}:
        raise SegmentError("malformed", "meta section lacks kv/snapshot/logits")
    if not all(isinstance(m, dict) for m in meta.values()):
        raise SegmentError("malformed", "meta entries must be objects")
    return meta


def decode_segment(data, compat_digest: str, limits: SegmentLimits = DEFAULT_LIMITS) -> Segment:
    """Parse and fully verify a segment file's bytes; raises SegmentError, never returns wrong data.

    Verifies the header, every section checksum, the end marker's sections digest (which binds the
    sections to this header), the compatibility digest, that key == segment_key(parent, tokens), and that
    the snapshot's tensor layout covers its section exactly. The payloads of a writable `data` (a buffer
    the file was read into) are views of it, not copies: they are valid while that buffer is.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    header = read_header(view[:HEADER_BYTES], compat_digest, view.nbytes, limits)
    sections_digest = check_end_marker(view[header.file_bytes - END_BYTES :], header)
    payloads, sums = _read_sections(view, header, limits)
    if _checksum(bytes(view[_HEADER.size : HEADER_BYTES]), *sums) != sections_digest:
        raise SegmentError("checksum", "sections digest in the end marker mismatch")
    if len(payloads[SECTION_TOKENS]) != 4 * header.num_tokens:
        raise SegmentError("malformed", "token section length differs from the token count")
    tokens = _tokens_from_bytes(payloads[SECTION_TOKENS])
    if segment_key(header.parent_key, tokens) != header.key:
        raise SegmentError("malformed", "key is not the hash of parent key and tokens")
    meta = _parse_meta(payloads[SECTION_META], limits)
    if SECTION_SNAPSHOT in payloads:
        try:
            read_layout(meta["snapshot"], len(payloads[SECTION_SNAPSHOT]))
        except LayoutError as e:
            raise SegmentError("malformed", f"snapshot section: {e}") from None
    return Segment(key=header.key, parent_key=header.parent_key, start_position=header.start_position,
                   tokens=tokens, kv_bytes=payloads[SECTION_KV], kv_meta=meta["kv"],
                   snapshot_bytes=payloads.get(SECTION_SNAPSHOT), snapshot_meta=meta["snapshot"],
                   logits_bytes=payloads.get(SECTION_LOGITS), logits_meta=meta["logits"])


def tokens_section_bytes(header: SegmentHeader) -> int:
    """Bytes of the tokens section (its header and payload), which comes first after the file header."""
    return SECTION_HEADER_BYTES + 4 * header.num_tokens


def decode_tokens(section, header: SegmentHeader) -> tuple[int, ...]:
    """The tokens of a segment from its first section alone (checksum and key verified): enough to index
    the segment at start-up without reading its KV. Raises SegmentError."""
    view = memoryview(section).cast("B") if not isinstance(section, memoryview) else section
    if view.nbytes < tokens_section_bytes(header):
        raise SegmentError("truncated", "tokens section cut short")
    got_id, stored_bytes, raw_bytes = _SECTION.unpack_from(view, 0)
    if got_id != SECTION_TOKENS or stored_bytes != raw_bytes or stored_bytes != 4 * header.num_tokens:
        raise SegmentError("malformed", "tokens section header disagrees with the file header")
    payload = view[SECTION_HEADER_BYTES : SECTION_HEADER_BYTES + stored_bytes]
    if _checksum(view[: _SECTION.size], payload) != bytes(view[_SECTION.size : SECTION_HEADER_BYTES]):
        raise SegmentError("checksum", "tokens section checksum mismatch")
    tokens = _tokens_from_bytes(bytes(payload))
    if segment_key(header.parent_key, tokens) != header.key:
        raise SegmentError("malformed", "key is not the hash of parent key and tokens")
    return tokens
