"""Remote-tier figures, measured side by side in one run (a benchmark, not a test).

1. Restore bandwidth of RedisSegmentStore.get (GET, then every section checksum, the version and the
   namespace verified) against a plain redis-py GET of the same bytes; alternating, median of --repeats.
2. A lookup by prompt (one pipelined GET of the index entries at every page multiple of a --prompt-tokens
   prompt, then the chain's keys recomputed from the prompt) against one plain GET of a small key.

Starts its own redis-server (no persistence) on a free loopback port, unless --url is given.

    PYTHONPATH=. python benchmarks/remote_bench.py --kv-mib 16 --snapshot-mib 4 --out benchmarks/out/remote_bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator

from cairn.cache.remote.client import connect
from cairn.cache.remote.keys import prefix_keys
from cairn.cache.remote.store import RedisSegmentStore
from cairn.cache.segments.named_bytes import layout_meta
from cairn.cache.segments.segment import Segment, segment_key

NAMESPACE = "ab" * 32
PAGE = 16


@contextlib.contextmanager
def started_redis() -> Iterator[str]:
    """A redis-server without persistence on a free loopback port, in a temporary work dir; yields its URL,
    then stops it and removes the dir (also when it did not start)."""
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="cairn-redis-bench-") as workdir:
        proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save",
                                 "", "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            for _ in range(200):
                with contextlib.suppress(redis.ConnectionError):
                    redis.Redis.from_url(url).ping()
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError("redis-server did not start")
            yield url
        finally:
            proc.terminate()
            proc.wait()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def restore_figures(store: RedisSegmentStore, kv_mib: float, snapshot_mib: float, repeats: int) -> dict:
    tokens = list(range(1024))
    snapshot_bytes = int(snapshot_mib * 2**20)
    segment = Segment(segment_key(None, tokens), None, 0, tokens, kv_bytes=os.urandom(int(kv_mib * 2**20)),
                      snapshot_bytes=os.urandom(snapshot_bytes), logits_bytes=os.urandom(4 * 1024),
                      snapshot_meta=layout_meta([("state", "uint8", (snapshot_bytes,))]))
    assert store.put(segment) and store.flush(60)
    name = store.names.segment(segment.key)
    plain_client = connect(store.url, 30.0)
    nbytes = len(plain_client.get(name))
    plain, verified = [], []
    for _ in range(repeats):  # alternating, so both see the same machine load
        plain.append(timed(lambda: plain_client.get(name)))
        verified.append(timed(lambda: store.get(segment.key)))
    return {"value_bytes": nbytes, "plain_get_s": statistics.median(plain), "store_get_s": statistics.median(verified),
            "plain_get_mib_s": nbytes / 2**20 / statistics.median(plain),
            "store_get_mib_s": nbytes / 2**20 / statistics.median(verified),
            "ratio": statistics.median(plain) / statistics.median(verified)}


def lookup_figures(store: RedisSegmentStore, prompt_tokens: int, repeats: int) -> dict:
    tokens = list(range(7, 7 + prompt_tokens))
    half = prompt_tokens // 2
    parent = prefix_keys(tokens, [half])[half]
    first, second = tokens[:half], tokens[half:]
    meta = layout_meta([("state", "uint8", (1,))])
    for seg in (Segment(segment_key(None, first), None, 0, first, b"k" * 64, snapshot_bytes=b"s", snapshot_meta=meta),
                Segment(segment_key(parent, second), parent, half, second, b"k" * 64, snapshot_bytes=b"s",
                        snapshot_meta=meta)):
        assert store.put(seg)
    assert store.flush(60)
    reader = RedisSegmentStore(store.url, NAMESPACE, PAGE)
    positions = range(PAGE, prompt_tokens + 1, PAGE)
    small = store.names.segment(segment_key(None, tokens[:half]))
    plain_client = connect(store.url, 30.0)
    plain, looked = [], []
    for _ in range(repeats):
        plain.append(timed(lambda: plain_client.get(small)))
        looked.append(timed(lambda: reader.lookup(tokens, positions)))
    assert [i.start_position for i in reader.lookup(tokens, positions)] == [0, half]
    reader.close()
    return {"prompt_tokens": prompt_tokens, "probed_positions": len(positions),
            "plain_get_s": statistics.median(plain), "lookup_s": statistics.median(looked)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an existing Redis (default: start one)")
    p.add_argument("--kv-mib", type=float, default=16.0)
    p.add_argument("--snapshot-mib", type=float, default=4.0)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out")
    ns = p.parse_args()
    with contextlib.nullcontext(ns.url) if ns.url else started_redis() as url:
        store = RedisSegmentStore(url, NAMESPACE, PAGE, timeout_s=30.0)
        result = {"restore": restore_figures(store, ns.kv_mib, ns.snapshot_mib, ns.repeats),
                  "lookup": lookup_figures(store, ns.prompt_tokens, ns.repeats)}
        store.close()
    print(json.dumps(result, indent=2))
    if ns.out:
        os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
