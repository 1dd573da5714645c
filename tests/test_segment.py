"""The segment file format: keys chain, encode/decode round-trips, and every damaged file is refused."""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
import types

import pytest
import xxhash

from cairn.cache.segments import segment as fmt
from cairn.cache.segments.decode import decode_segment, read_header
from cairn.cache.segments.named_bytes import layout_meta
from cairn.cache.segments.segment import HEADER_BYTES, Segment, SegmentError, SegmentLimits, encode_segment, segment_key

DIGEST = "c0ffee" * 8
OTHER_DIGEST = "beef" * 16


def make_segment(tokens=(5, 6, 7, 8), parent=None, start=0, kv=b"K" * 300, snapshot=b"S" * 200,
                 logits=b"L" * 100) -> Segment:
    return Segment(key=segment_key(parent, tokens), parent_key=parent, start_position=start, tokens=tokens,
                   kv_bytes=kv, kv_meta={"shape": [2, 4], "dtype": "bfloat16"}, snapshot_bytes=snapshot,
                   snapshot_meta=raw_layout(snapshot), logits_bytes=logits,
                   logits_meta={"vocab": 25} if logits is not None else {})


def raw_layout(snapshot: bytes | None) -> dict:
    """A snapshot section's meta for opaque bytes: one uint8 tensor over all of them."""
    return {} if snapshot is None else layout_meta([("state", "uint8", (len(snapshot),))])


def checksum16(*parts) -> bytes:
    """The format's checksum, recomputed independently: XXH3-128 of the parts, in order."""
    return xxhash.xxh3_128(b"".join(bytes(p) for p in parts)).digest()


def reseal(data: bytes | bytearray) -> bytes:
    """Recompute every checksum of an edited file, as a buggy or hostile writer would."""
    data = bytearray(data)
    data[HEADER_BYTES - 16 : HEADER_BYTES] = checksum16(data[: HEADER_BYTES - 16])
    sums, offset, end = [], HEADER_BYTES, len(data) - fmt.END_BYTES
    while offset < end:
        _, stored, _ = struct.unpack_from("<IQQ", data, offset)
        body = offset + fmt.SECTION_HEADER_BYTES
        data[offset + 20 : body] = checksum16(data[offset : offset + 20], data[body : body + stored])
        sums.append(bytes(data[offset + 20 : body]))
        offset = body + stored
    data[-16:] = checksum16(data[HEADER_BYTES - 16 : HEADER_BYTES], *sums)
    return bytes(data)


def test_segment_key_is_32_bytes_and_chains_parent_and_tokens():
    a = segment_key(None, [1, 2, 3])
    assert len(a) == 32
    assert segment_key(None, (1, 2, 3)) == a  # equal prefixes, equal keys, whatever the container
    assert segment_key(None, [1, 2, 4]) != a
    b = segment_key(a, [4, 5])
    assert segment_key(segment_key(None, [1, 2, 3]), [4, 5]) == b
    assert segment_key(segment_key(None, [1, 2, 9]), [4, 5]) != b  # a different prefix changes every descendant
    assert segment_key(fmt.ROOT_KEY, [1, 2, 3]) == a  # None means the root marker


def test_segment_key_is_stable_across_processes_and_versions():
    # A changed key function silently orphans every durable cache: these values must never change.
    a = segment_key(None, [1, 2, 3])
    assert a.hex() == "8474a380da36750f3cd3c80e1304358b3b545caa0f0f6f2310f1bc7a3786978c"
    assert segment_key(a, [4, 5]).hex() == "eb27bdf46c82c27c8c5138bbff7a9ee5b0c641b3ff135d524f7dbd37cd1e6637"


def test_segment_key_rejects_bad_parent_and_tokens():
    with pytest.raises(ValueError):
        segment_key(b"short", [1])
    with pytest.raises(ValueError):
        segment_key(None, [-1])
    with pytest.raises(ValueError):
        segment_key(None, [2**32])


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
@pytest.mark.parametrize("with_extras", [True, False])
def test_encode_decode_round_trips_every_field(compression, with_extras):
    parent = segment_key(None, [1, 2])
    seg = make_segment(parent=parent, start=2, kv=bytes(range(256)) * 40,
                       snapshot=b"\x00" * 4096 if with_extras else None, logits=b"\x01" * 64 if with_extras else None)
    data = encode_segment(seg, DIGEST, compression)
    assert decode_segment(data, DIGEST) == seg
    header = read_header(data[:HEADER_BYTES], DIGEST, len(data))
    assert (header.key, header.parent_key, header.start_position, header.num_tokens) == (seg.key, parent, 2, 4)
    assert header.has_snapshot == header.has_logits == with_extras


def test_compression_is_kept_only_for_sections_it_shrinks():
    seg = make_segment(kv=os.urandom(4096), snapshot=bytes(4096), logits=None)
    data = encode_segment(seg, DIGEST, "zstd")
    header = read_header(data, DIGEST, len(data))
    assert not header.flags & fmt.FLAG_KV_COMPRESSED  # random bytes: stored raw
    assert header.flags & fmt.FLAG_SNAPSHOT_COMPRESSED
    assert len(data) < len(encode_segment(seg, DIGEST))
    assert decode_segment(data, DIGEST) == seg


def test_encode_rejects_inconsistent_segments():
    seg = make_segment()
    with pytest.raises(ValueError):
        encode_segment(Segment(b"\x00" * 32, None, 0, (1,), b""), DIGEST)  # key is not the hash
    with pytest.raises(ValueError):
        encode_segment(Segment(segment_key(None, ()), None, 0, (), b""), DIGEST)  # no tokens
    with pytest.raises(ValueError):
        encode_segment(seg, "../etc")  # digest must be hex
    with pytest.raises(ValueError):
        encode_segment(seg, DIGEST, compression="gzip")
    with pytest.raises(SegmentError) as e:
        encode_segment(seg, DIGEST, limits=SegmentLimits(max_file_bytes=100))
    assert e.value.reason == "oversized"
    refused = {"parent_key must be 32 bytes": dataclasses.replace(seg, parent_key=b"short"),
               "start_position out of range": dataclasses.replace(seg, start_position=-1),
               "must be dicts": dataclasses.replace(seg, kv_meta=[2, 4]),
               "not JSON-serialisable": dataclasses.replace(seg, logits_meta={"vocab": float("nan")})}
    for message, bad in refused.items():
        with pytest.raises(ValueError, match=message):
            encode_segment(bad, DIGEST)
    for limits, message in ((SegmentLimits(max_tokens=3), "4 tokens > max_tokens 3"),
                            (SegmentLimits(max_meta_bytes=10), "max_meta_bytes 10")):
        with pytest.raises(SegmentError, match=message) as e:
            encode_segment(seg, DIGEST, limits=limits)
        assert e.value.reason == "oversized"


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_codec_that_is_not_installed_refuses_to_write_and_says_so_on_read(monkeypatch, codec):
    """(A cache directory written with a compression by one installation, read by one without that module.)"""
    seg = make_segment(kv=bytes(10_000), snapshot=None, logits=None)
    data = encode_segment(seg, DIGEST, codec)
    module = "zstandard" if codec == "zstd" else "lz4.block"
    monkeypatch.setitem(sys.modules, module, None)  # its import now raises ImportError
    with pytest.raises(ValueError, match="is not installed"):
        encode_segment(seg, DIGEST, codec)
    with pytest.raises(SegmentError, match="is not available in this build") as e:
        decode_segment(data, DIGEST)
    assert e.value.reason == "version"
    assert decode_segment(encode_segment(seg, DIGEST), DIGEST) == seg  # stored raw: fine without the module


def test_a_codec_that_decompresses_to_another_size_is_malformed(monkeypatch):
    """A codec module that hands back fewer bytes than the section's raw size without raising (another build
    of it): the section is refused, not used short."""
    seg = make_segment(kv=bytes(10_000), snapshot=None, logits=None)
    data = encode_segment(seg, DIGEST, "lz4")
    real = fmt._codec_module(fmt.CODECS["lz4"])
    short = types.SimpleNamespace(decompress=lambda data, uncompressed_size: real.decompress(
        data, uncompressed_size=uncompressed_size)[:-1])
    monkeypatch.setattr(fmt, "_codec_module", lambda codec: short)
    with pytest.raises(SegmentError, match="decompressed size differs") as e:
        decode_segment(data, DIGEST)
    assert e.value.reason == "malformed"


def test_every_strict_prefix_of_a_file_is_truncated_or_empty():
    data = encode_segment(make_segment(), DIGEST)
    for n in range(len(data)):
        with pytest.raises(SegmentError) as e:
            decode_segment(data[:n], DIGEST)
        assert e.value.reason == ("empty" if n == 0 else "truncated"), n


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_no_single_bit_flip_anywhere_decodes(compression):
    seg = make_segment(kv=b"kv" * 40, snapshot=bytes(64), logits=b"lg" * 8)
    data = encode_segment(seg, DIGEST, compression)
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        with pytest.raises(SegmentError):
            decode_segment(bytes(flipped), DIGEST)


def test_every_stored_checksum_is_xxh3_128_of_its_bytes():
    data = encode_segment(make_segment(kv=b"kv" * 500, snapshot=bytes(3000), logits=b"lg" * 50), DIGEST)
    assert data[HEADER_BYTES - 16 : HEADER_BYTES] == checksum16(data[: HEADER_BYTES - 16])
    sums, offset = [], HEADER_BYTES
    while offset < len(data) - fmt.END_BYTES:
        _, stored, _ = struct.unpack_from("<IQQ", data, offset)
        body = offset + fmt.SECTION_HEADER_BYTES
        sums.append(data[offset + 20 : body])
        assert sums[-1] == checksum16(data[offset : offset + 20], data[body : body + stored])
        offset = body + stored
    assert len(sums) == 5
    assert data[-16:] == checksum16(data[HEADER_BYTES - 16 : HEADER_BYTES], *sums)


def test_wrong_magic_version_and_digest_have_their_reasons():
    data = encode_segment(make_segment(), DIGEST)
    cases = {"magic": b"NOTCAIRN" + data[8:],
             "version": reseal(data[:8] + struct.pack("<H", fmt.FORMAT_VERSION + 1) + data[10:])}
    for reason, bad in cases.items():
        with pytest.raises(SegmentError) as e:
            decode_segment(bad, DIGEST)
        assert e.value.reason == reason
    with pytest.raises(SegmentError) as e:
        decode_segment(data, OTHER_DIGEST)
    assert e.value.reason == "foreign_model"


def test_lengths_are_bounded_by_limits_before_use():
    data = encode_segment(make_segment(), DIGEST)
    for limits in (SegmentLimits(max_tokens=3), SegmentLimits(max_meta_bytes=10), SegmentLimits(max_section_bytes=250),
                   SegmentLimits(max_file_bytes=len(data) - 1)):
        with pytest.raises(SegmentError) as e:
            decode_segment(data, DIGEST, limits)
        assert e.value.reason == "oversized", limits


def test_resealed_inconsistencies_are_malformed_not_trusted():
    seg = make_segment()
    data = bytearray(encode_segment(seg, DIGEST))
    kv_section = HEADER_BYTES + fmt.SECTION_HEADER_BYTES + 16  # after the 4-token section
    wrong_id = data.copy()
    struct.pack_into("<I", wrong_id, kv_section, fmt.SECTION_SNAPSHOT)
    wrong_tokens = data.copy()
    wrong_tokens[HEADER_BYTES + fmt.SECTION_HEADER_BYTES] ^= 1  # key no longer hashes the tokens
    trailing = bytes(data) + b"\x00"
    for bad in (reseal(wrong_id), reseal(wrong_tokens)):
        with pytest.raises(SegmentError) as e:
            decode_segment(bad, DIGEST)
        assert e.value.reason == "malformed"
    with pytest.raises(SegmentError) as e:
        decode_segment(trailing, DIGEST)
    assert e.value.reason == "malformed"


def test_compressed_section_cannot_claim_a_different_raw_size():
    seg = make_segment(kv=bytes(10_000), snapshot=None, logits=None)
    data = bytearray(encode_segment(seg, DIGEST, "zstd"))
    kv_section = HEADER_BYTES + fmt.SECTION_HEADER_BYTES + 16
    _, stored, raw = struct.unpack_from("<IQQ", data, kv_section)
    struct.pack_into("<IQQ", data, kv_section, fmt.SECTION_KV, stored, raw + 1)
    with pytest.raises(SegmentError) as e:
        decode_segment(reseal(data), DIGEST)
    assert e.value.reason == "malformed"
