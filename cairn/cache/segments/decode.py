"""Reading a segment file back (segment.py's format): strict, bounded decoding that verifies everything.

    read_header(data, digest, file_bytes)   the fixed-size header alone: enough to index a file at start-up
    check_end_marker(data, header)          the end marker, which binds the sections to the header
    decode_tokens(section, header)          the tokens alone, from the first section (checksum and key checked)
    decode_segment(data, digest)            the whole segment, every checksum, the key and the snapshot layout

Every length is checked against `SegmentLimits` before anything is allocated, and every refusal is a
`SegmentError` with its reason (truncated, checksum, version, magic, foreign_model, oversized, malformed,
empty): a file that fails any check is never loaded, never returns wrong data. What this is not: the format's
definition or the encoder (segment.py), nor what becomes of a bad file (the store's: disk/store.py and
disk/entries.py, remote/store.py).
"""

from __future__ import annotations

import json

from cairn.cache.segments.named_bytes import LayoutError, read_layout
from cairn.cache.segments.segment import (
    CODECS,
    DEFAULT_LIMITS,
    END_BYTES,
    END_MAGIC,
    END_STRUCT,
    FLAG_HAS_LOGITS,
    FLAG_HAS_PARENT,
    FLAG_HAS_SNAPSHOT,
    FLAG_KV_COMPRESSED,
    FLAG_LOGITS_COMPRESSED,
    FLAG_SNAPSHOT_COMPRESSED,
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_STRUCT,
    KNOWN_FLAGS,
    MAGIC,
    MAX_DIGEST_BYTES,
    SECTION_HEADER_BYTES,
    SECTION_KV,
    SECTION_LOGITS,
    SECTION_META,
    SECTION_SNAPSHOT,
    SECTION_STRUCT,
    SECTION_TOKENS,
    Segment,
    SegmentError,
    SegmentHeader,
    SegmentLimits,
    checksum,
    decompress,
    digest_bytes,
    segment_key,
    tokens_from_bytes,
)


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
    fields = HEADER_STRUCT.unpack_from(data)
    _, version, codec, digest_len, flags, digest, key, parent, start, num_tokens, declared_bytes = fields
    if version != FORMAT_VERSION:
        raise SegmentError("version", f"format version {version}, this build reads {FORMAT_VERSION}")
    if checksum(data[: HEADER_STRUCT.size]) != data[HEADER_STRUCT.size :]:
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
    if (codec not in CODECS.values() or flags & ~KNOWN_FLAGS or (flags & compressed and codec == 0)
            or not 1 <= digest_len <= MAX_DIGEST_BYTES or any(digest[digest_len:])
            or (not flags & FLAG_HAS_PARENT and any(parent))):
        raise SegmentError("malformed", "inconsistent header fields")


def check_end_marker(data, header: SegmentHeader) -> bytes:
    """Validate the last END_BYTES of the file; returns the sections digest it records."""
    if len(data) != END_BYTES:
        raise SegmentError("truncated", "no end marker")
    magic, file_bytes, sections_digest = END_STRUCT.unpack(bytes(data))
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
        got_id, stored_bytes, raw_bytes = SECTION_STRUCT.unpack_from(view, offset)
        body = offset + SECTION_HEADER_BYTES
        if got_id != section_id or stored_bytes > end - body:
            raise SegmentError("malformed", f"section {section_id}: unexpected id {got_id} or length {stored_bytes}")
        if raw_bytes > limits.max_section_bytes:
            raise SegmentError("oversized", f"section {section_id} of {raw_bytes} bytes > max_section_bytes")
        stored = view[body : body + stored_bytes]
        sums.append(bytes(view[offset + SECTION_STRUCT.size : body]))
        if checksum(view[offset : offset + SECTION_STRUCT.size], stored) != sums[-1]:
            raise SegmentError("checksum", f"section {section_id} checksum mismatch")
        if header.flags & compress_flag:
            payloads[section_id] = decompress(header.codec, stored, raw_bytes)
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
    if checksum(bytes(view[HEADER_STRUCT.size : HEADER_BYTES]), *sums) != sections_digest:
        raise SegmentError("checksum", "sections digest in the end marker mismatch")
    if len(payloads[SECTION_TOKENS]) != 4 * header.num_tokens:
        raise SegmentError("malformed", "token section length differs from the token count")
    tokens = tokens_from_bytes(payloads[SECTION_TOKENS])
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
    got_id, stored_bytes, raw_bytes = SECTION_STRUCT.unpack_from(view, 0)
    if got_id != SECTION_TOKENS or stored_bytes != raw_bytes or stored_bytes != 4 * header.num_tokens:
        raise SegmentError("malformed", "tokens section header disagrees with the file header")
    payload = view[SECTION_HEADER_BYTES : SECTION_HEADER_BYTES + stored_bytes]
    if checksum(view[: SECTION_STRUCT.size], payload) != bytes(view[SECTION_STRUCT.size : SECTION_HEADER_BYTES]):
        raise SegmentError("checksum", "tokens section checksum mismatch")
    tokens = tokens_from_bytes(bytes(payload))
    if segment_key(header.parent_key, tokens) != header.key:
        raise SegmentError("malformed", "key is not the hash of parent key and tokens")
    return tokens
