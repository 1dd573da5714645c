"""Segment files whose every checksum is right but whose structure is not: what a buggy or hostile writer
leaves in a cache directory (random damage is caught by the checksums first, tests/test_disk_faults.py).
Each is written into a real namespace, read by the store as the engine reads it (`get` on a resume,
`get_tokens` when the tree is rebuilt at start-up), refused as "malformed" and counted, never loaded;
the store keeps serving its other segments.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from cairn.cache.disk.store import DiskStore
from cairn.cache.segments.segment import (
    END_BYTES,
    HEADER_BYTES,
    SECTION_HEADER_BYTES,
    SECTION_KV,
    SECTION_META,
    SECTION_TOKENS,
    encode_segment,
)
from tests.test_disk_faults import BUDGET_BYTES, DIGEST, make_segment
from tests.test_segment import reseal

_SECTION = struct.Struct("<IQQ")
FLAGS_AT, NUM_TOKENS_AT, FILE_BYTES_AT = 12, 152, 156  # offsets in the file header (segment.py's table)


@dataclass
class Parts:
    """A segment file taken apart: header fields to edit, and its sections as (id, stored, raw, payload)."""

    header: bytearray
    sections: list[list] = field(default_factory=list)

    @classmethod
    def of(cls, data: bytes) -> Parts:
        parts, offset = cls(bytearray(data[:HEADER_BYTES])), HEADER_BYTES
        while offset < len(data) - END_BYTES:
            sid, stored, raw = _SECTION.unpack_from(data, offset)
            body = offset + SECTION_HEADER_BYTES
            parts.sections.append([sid, stored, raw, data[body:body + stored]])
            offset = body + stored
        return parts

    def section(self, sid: int) -> list:
        return next(s for s in self.sections if s[0] == sid)

    def set_payload(self, sid: int, payload: bytes) -> None:
        s = self.section(sid)
        s[1] = s[2] = len(payload)
        s[3] = payload

    def build(self, trailing: bytes = b"") -> bytes:
        """The file, its declared sizes matching its length, every checksum recomputed."""
        body = b"".join(_SECTION.pack(sid, stored, raw) + bytes(16) + payload
                        for sid, stored, raw, payload in self.sections)
        size = HEADER_BYTES + len(body) + len(trailing) + END_BYTES
        struct.pack_into("<Q", self.header, FILE_BYTES_AT, size)
        end = b"CAIRNEND" + struct.pack("<Q", size) + bytes(16)
        sealed = reseal(bytes(self.header) + body + end)  # checksums of the sections (trailing bytes have none)
        return sealed[:-END_BYTES] + trailing + sealed[-END_BYTES:]


def edit_flags(parts: Parts) -> bytes:
    struct.pack_into("<I", parts.header, FLAGS_AT, struct.unpack_from("<I", parts.header, FLAGS_AT)[0] | 1 << 7)
    return parts.build()


def zero_tokens(parts: Parts) -> bytes:
    struct.pack_into("<I", parts.header, NUM_TOKENS_AT, 0)
    return parts.build()


def meta_section_missing(parts: Parts) -> bytes:
    parts.sections = [s for s in parts.sections if s[0] != SECTION_META]
    return parts.build()


def kv_stored_and_raw_sizes_differ(parts: Parts) -> bytes:
    parts.section(SECTION_KV)[2] += 1  # raw says one byte more, the section is not compressed
    return parts.build()


def bytes_before_the_end_marker(parts: Parts) -> bytes:
    return parts.build(trailing=b"x" * 7)


def meta(payload: bytes) -> Callable[[Parts], bytes]:
    def with_meta(parts: Parts) -> bytes:
        parts.set_payload(SECTION_META, payload)
        return parts.build()
    with_meta.__name__ = f"meta_{payload.decode()[:12]}"
    return with_meta


def one_token_more_in_the_section(parts: Parts) -> bytes:
    parts.set_payload(SECTION_TOKENS, parts.section(SECTION_TOKENS)[3] + struct.pack("<I", 7))
    return parts.build()


def another_token(parts: Parts) -> bytes:
    tokens = bytearray(parts.section(SECTION_TOKENS)[3])
    tokens[0] ^= 1  # the key no longer hashes the tokens
    parts.set_payload(SECTION_TOKENS, bytes(tokens))
    return parts.build()


CRAFTED = [edit_flags, zero_tokens, meta_section_missing, kv_stored_and_raw_sizes_differ, bytes_before_the_end_marker,
           meta(b"{not json"), meta(b"{}"), meta(b'{"kv":1,"snapshot":{},"logits":{}}'),
           one_token_more_in_the_section, another_token]


def stored_victim(tmp_path, craft: Callable[[Parts], bytes], compression=None):
    """A namespace holding a healthy segment and a crafted one written under the victim's name."""
    victim, other = make_segment(100), make_segment(200)
    with DiskStore(tmp_path, DIGEST, BUDGET_BYTES, compression=compression) as store:
        assert store.put(victim) and store.put(other)
    path = tmp_path / DIGEST / f"{victim.key.hex()}.seg"
    path.write_bytes(craft(Parts.of(encode_segment(victim, DIGEST, compression))))
    return victim, other, path


@pytest.mark.parametrize("craft", CRAFTED, ids=lambda c: c.__name__)
def test_a_resealed_segment_with_a_malformed_structure_is_refused_where_the_engine_reads_it(tmp_path, craft):
    victim, other, path = stored_victim(tmp_path, craft)
    with DiskStore(tmp_path, DIGEST, BUDGET_BYTES) as store:
        indexed = store.info(victim.key) is not None  # the header and end marker may pass the start-up check
        got = store.get(victim.key) if indexed else None
        assert got is None and store.info(victim.key) is None
        assert store.faults == {"malformed": 1}, store.faults
        assert store.get(other.key) == other
        store.check_integrity()
    assert not path.exists()  # ours and damaged: deleted


def more_tokens_than_the_file_holds(parts: Parts) -> bytes:
    struct.pack_into("<I", parts.header, NUM_TOKENS_AT, 1000)
    return parts.build()


@pytest.mark.parametrize(("craft", "reason"), [(one_token_more_in_the_section, "malformed"),
                                               (another_token, "malformed"),
                                               (more_tokens_than_the_file_holds, "truncated")],
                         ids=lambda c: getattr(c, "__name__", c))
def test_a_crafted_tokens_section_is_refused_when_the_tree_is_rebuilt_at_start_up(tmp_path, craft, reason):
    victim, other, _ = stored_victim(tmp_path, craft)
    with DiskStore(tmp_path, DIGEST, BUDGET_BYTES) as store:
        assert store.get_tokens(victim.key) is None and store.faults == {reason: 1}
        assert store.get_tokens(other.key) == other.tokens


def test_a_crafted_tokens_section_checksum_is_refused_at_start_up(tmp_path):
    def bad_token_checksum(parts: Parts) -> bytes:
        data = bytearray(parts.build())
        data[HEADER_BYTES + _SECTION.size] ^= 1  # the tokens section's own checksum, nothing else
        return bytes(data)

    victim, other, _ = stored_victim(tmp_path, bad_token_checksum)
    with DiskStore(tmp_path, DIGEST, BUDGET_BYTES) as store:
        assert store.get_tokens(victim.key) is None and store.faults == {"checksum": 1}
        assert store.get_tokens(other.key) == other.tokens


def test_a_compressed_section_that_does_not_decompress_is_refused(tmp_path):
    victim = make_segment(100)
    data = encode_segment(victim, DIGEST, "zstd")
    parts = Parts.of(data)
    assert parts.section(SECTION_KV)[1] < parts.section(SECTION_KV)[2]  # stored compressed

    def garbled_frame(parts: Parts) -> bytes:
        kv = parts.section(SECTION_KV)
        kv[3] = kv[3][:14] + bytes(len(kv[3]) - 14)  # the frame header (with its content size) kept, blocks zeroed
        return parts.build()

    _, other, path = stored_victim(tmp_path, garbled_frame, compression="zstd")
    with DiskStore(tmp_path, DIGEST, BUDGET_BYTES, compression="zstd") as store:
        assert store.get(victim.key) is None and store.faults == {"malformed": 1}
        assert store.get(other.key) == other
    assert not path.exists()



def snapshot_layout(tensors) -> Callable[[Parts], bytes]:
    """The victim's meta with this snapshot layout (its section: 1000 bytes) in place of its own."""
    def with_layout(parts: Parts) -> bytes:
        victim = make_segment(100)
        meta = {"kv": victim.kv_meta, "snapshot": tensors, "logits": victim.logits_meta}
        parts.set_payload(SECTION_META, json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
        return parts.build()
    return with_layout


HALF = {"name": "state", "dtype": "uint8", "shape": [500], "offset": 0, "nbytes": 500}
LAYOUTS = {
    "not_a_tensor_list": {"tensors": "state"},
    "a_name_twice": {"tensors": [HALF, {**HALF, "offset": 500}]},
    "an_entry_without_its_fields": {"tensors": [{"name": "state"}]},
    "an_unknown_dtype": {"tensors": [{**HALF, "dtype": "complex256", "shape": [1000], "nbytes": 1000}]},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_snapshot_layout_that_does_not_describe_its_section_is_refused(tmp_path, layout):
    victim, other, path = stored_victim(tmp_path, snapshot_layout(LAYOUTS[layout]))
    with DiskStore(tmp_path, DIGEST, BUDGET_BYTES) as store:
        assert store.get(victim.key) is None and store.faults == {"malformed": 1}
        assert store.get(other.key) == other
    assert not path.exists()
