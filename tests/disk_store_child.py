"""A child process for the disk store tests: holds a namespace's lock, writes in a loop, or hits EFBIG.

    python tests/disk_store_child.py hold ROOT DIGEST          open a store, print "ready", wait for stdin EOF
    python tests/disk_store_child.py write_loop ROOT DIGEST SEED   print "ready", then put segments forever
    python tests/disk_store_child.py efbig ROOT DIGEST         put under RLIMIT_FSIZE; print a JSON report

Not a test itself; it imports only the torch-free store so that it starts in a few tens of ms.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cairn.cache.disk.store import DiskStore  # noqa: E402
from cairn.cache.segments.named_bytes import layout_meta  # noqa: E402
from cairn.cache.segments.segment import Segment, segment_key  # noqa: E402


def make(parent: bytes | None, start: int, num_tokens: int, kv_bytes: int, rng: random.Random) -> Segment:
    tokens = [rng.randrange(50_000) for _ in range(num_tokens)]
    kv = rng.randbytes(kv_bytes)
    snapshot = rng.randbytes(kv_bytes // 2) if rng.random() < 0.5 else None
    return Segment(segment_key(parent, tokens), parent, start, tokens, kv, {"n": kv_bytes},
                   snapshot_bytes=snapshot,
                   snapshot_meta=layout_meta([("state", "uint8", (len(snapshot),))]) if snapshot else {})


def hold(root: str, digest: str) -> None:
    with DiskStore(root, digest, 1 << 30):
        print("ready", flush=True)
        sys.stdin.read()


def write_loop(root: str, digest: str, seed: int) -> None:
    rng = random.Random(seed)
    store = DiskStore(root, digest, budget_bytes=3 << 20)
    print("ready", flush=True)
    parent, start = None, 0
    while True:
        seg = make(parent, start, rng.randrange(1, 64), rng.randrange(1, 256 << 10), rng)
        store.put(seg)
        parent, start = (seg.key, seg.end_position) if rng.random() < 0.7 else (None, 0)


def efbig(root: str, digest: str) -> None:
    rng = random.Random(0)
    store = DiskStore(root, digest, budget_bytes=1 << 30)
    small, big = make(None, 0, 8, 8 << 10, rng), make(None, 0, 9, 256 << 10, rng)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    report = {"small_put": store.put(small), "big_put": store.put(big)}
    got = store.get(small.key)
    report |= {"small_get_ok": got == small, "big_indexed": store.info(big.key) is not None, "faults": store.faults,
               "used_bytes": store.used_bytes, "files": sorted(os.listdir(os.path.join(root, digest)))}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"hold": hold, "write_loop": lambda r, d, s: write_loop(r, d, int(s)), "efbig": efbig}[mode](*args)
