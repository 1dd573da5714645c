"""Measure what disk-tier compression buys on synthetic data shaped like real cached state.

    python benchmarks/compression.py [--repeats 3]

Prints, per payload and codec, the stored/raw ratio and the time to encode and decode a whole
segment file (checksums included) with cairn.cache.segments.segment. This is a measurement script only,
not a test: random data is a pessimistic stand-in for real states, whose values are not i.i.d.

Payloads:
  state  fp32 recurrent state of one snapshot, shape [18, 16, 128, 128] (18.9 MB), N(0, 1)
  kv     bf16-like KV of 1024 tokens, [12 layers, 2 (K/V), 1024, 2 heads, 256] (25.2 MB): the upper
         16 bits of N(0, 1) fp32, as bf16 stores them
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cairn.cache.segments.decode import decode_segment
from cairn.cache.segments.segment import Segment, encode_segment, segment_key

DIGEST = "00" * 32


def synthetic_payloads(seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    state = rng.standard_normal((18, 16, 128, 128), dtype=np.float32)
    kv_fp32 = rng.standard_normal((12, 2, 1024, 2, 256), dtype=np.float32)
    kv_bf16 = (kv_fp32.view(np.uint32) >> 16).astype(np.uint16)
    return {"state": state.tobytes(), "kv": kv_bf16.tobytes()}


def measure(payload: bytes, compression: str | None, repeats: int) -> dict:
    """Best-of-`repeats` encode and decode seconds of a segment whose kv section is `payload`."""
    tokens = list(range(1024))
    segment = Segment(segment_key(None, tokens), None, 0, tokens, payload)
    encode_s, decode_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = encode_segment(segment, DIGEST, compression)
        t1 = time.perf_counter()
        decoded = decode_segment(data, DIGEST).kv_bytes
        t2 = time.perf_counter()
        assert bytes(decoded) == payload  # outside the timing: a view of `data` when stored uncompressed
        encode_s.append(t1 - t0)
        decode_s.append(t2 - t1)
    return {"ratio": len(data) / len(payload), "encode_s": min(encode_s), "decode_s": min(decode_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'payload':8} {'codec':6} {'MB':>7} {'stored/raw':>10} {'encode s':>9} {'decode s':>9} {'decode GB/s':>11}")
    for name, payload in synthetic_payloads().items():
        for codec in (None, "zstd", "lz4"):
            m = measure(payload, codec, args.repeats)
            print(f"{name:8} {codec or 'none':6} {len(payload) / 1e6:7.1f} {m['ratio']:10.3f} {m['encode_s']:9.3f} "
                  f"{m['decode_s']:9.3f} {len(payload) / m['decode_s'] / 1e9:11.2f}")


if __name__ == "__main__":
    main()
