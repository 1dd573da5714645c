"""Why round robin over replicas found little in Redis at the 0.8B size, and the two fixes, on a real redis-server.

1. A chain continues only from a segment's END. A conversation that shares a stored conversation's first
   tokens and then leaves it midway (inside a prefill block: no snapshot there) splits the node holding
   them: its front is a slice of the stored segment, and no segment ends where the new conversation's own
   segments begin. The remote tier wrote none of them (the store refused each as "unknown_parent"), so
   another replica never found them. Now the slice is written again as a segment of its own, its KV read
   from the finished request's pages (on a replica that found the stored conversation in Redis, no page
   tier holds it).
2. The next turn reaches the other replica as soon as the previous turn's last token is out, before that
   turn's write-behind has sent its segments. The writer now announces them (markers.py) and the reader's
   lookup waits, bounded, for a deeper chain another replica announced.

Engines are LLMs of the demo model (fp32, greedy) with --remote-cache and no disk or host tier, as in
test_remote_tier.py; the stores are two RedisSegmentStores standing for two replicas, as in
test_remote_store.py.
"""

from __future__ import annotations

import pytest

from cairn.cache.remote.keys import chain_keys, index_entries, prefix_keys
from cairn.cache.remote.store import RedisSegmentStore
from cairn.cache.segments.named_bytes import layout_meta
from cairn.cache.segments.segment import Segment
from cairn.cache.tree.nodes import REMOTE
from cairn.engine.llm import LLM
from tests.harness import run, same_as_cold
from tests.test_remote_tier import CONVERSATION, OPTS, remote

NS, PAGE = "cd" * 32, 4
BLOCK = 64


@pytest.fixture(scope="module")
def cold():
    return LLM(**OPTS, prefix_cache=False)


def aligned_replica(url: str) -> LLM:
    """A replica resuming only at blocks of BLOCK tokens (as bf16 does at 512): no snapshot where a prompt
    leaves a cached path inside a block, so the slice above the divergence has none of its own."""
    llm = LLM(**OPTS, remote_cache=url, prefill_block=BLOCK)
    remote(llm).store.redis.timeout_s = 5.0
    return llm


def test_a_conversation_leaving_a_stored_one_midway_is_written_and_resumed_on_another_replica(redis_server, cold):
    a, b = aligned_replica(redis_server.url), aligned_replica(redis_server.url)
    with a, b:
        first = run(a, CONVERSATION)  # stored in Redis as segments cut at its snapshots (64, 128, ...)
        assert remote(a).store.flush()
        run(b, CONVERSATION + first.token_ids + [5, 6, 7])  # B resumes it from Redis: its KV is in Redis only
        assert remote(b).store.flush()
        other = CONVERSATION[:20] + list(range(200, 250)) * 8  # leaves it at 20, inside its first segment
        reply = run(b, other)
        assert remote(b).store.flush()
        assert remote(b).counters["slices_rewritten"] == 1 and remote(b).store.faults == {}
        prompt = other + reply.token_ids + [5, 6, 7]
        out = run(a, prompt)  # A never saw this conversation
        assert out.cache.resume_tier == REMOTE and out.cache.cached_tokens == len(other) // BLOCK * BLOCK
        same_as_cold(cold, out, prompt)


def store(url: str, **kw) -> RedisSegmentStore:
    return RedisSegmentStore(url, NS, PAGE, timeout_s=10.0, cooldown_s=60.0, **kw)


def segments(tokens: list[int], bounds: list[int], kv_bytes: int = 64) -> list[Segment]:
    """A chain over tokens cut at bounds, each segment with a snapshot at its end."""
    keys, parents = chain_keys(tokens, bounds), prefix_keys(tokens, bounds[1:-1])
    return [Segment(key, parents.get(start), start, tokens[start:stop], kv_bytes=bytes([stop % 251]) * kv_bytes,
                    snapshot_bytes=b"S" * 32, snapshot_meta=layout_meta([("state", "uint8", (32,))]))
            for (start, stop), key in zip(zip(bounds, bounds[1:], strict=False), keys, strict=True)]


def test_a_lookup_waits_for_the_deeper_chain_another_replica_is_still_writing(redis_server):
    writer, reader = store(redis_server.url), store(redis_server.url)
    tokens = list(range(1000, 1064))
    first, second = segments(tokens, [0, 32, 64])
    assert writer.put(first) and writer.flush()
    for i in range(24):  # another conversation's writes, queued ahead (8 MiB each): the next one lands late
        assert writer.put(segments([i, 7, 7, 7], [0, 4], kv_bytes=8 << 20)[0])
    assert writer.put(second) and writer.markers.flush(5.0)  # as the writer does before a segment's write
    found = reader.lookup(tokens, range(PAGE, len(tokens) + 1, PAGE))
    assert [(i.start_position, i.num_tokens) for i in found] == [(0, 32), (32, 32)]
    assert reader.counted("lookups_waited") == 1 and reader.counted("lookup_waits_expired") == 0
    assert writer.lookup(tokens, [32, 64])[-1].num_tokens == 32  # its own markers: never waited for
    assert writer.counted("lookups_waited") == 0
    assert writer.flush(timeout_s=60.0)
    assert not any(redis_server.client().scan_iter(match=f"cairn:{NS}:w:*"))  # each write took its markers away
    writer.close(), reader.close()


def test_a_writer_that_announced_and_never_wrote_is_waited_for_at_most_wait_s(redis_server):
    writer, reader = store(redis_server.url), store(redis_server.url, wait_s=0.3)
    tokens = list(range(2000, 2064))
    first, second = segments(tokens, [0, 32, 64])
    assert writer.put(first) and writer.flush()
    bounds, start_hash, end_hash = writer._index.chain_of(second)
    entries = index_entries(second, bounds, start_hash, end_hash, PAGE)
    assert writer.markers.announce(entries) and writer.markers.flush(5.0)  # then it died: nothing is written
    found = reader.lookup(tokens, range(PAGE, len(tokens) + 1, PAGE))
    assert [(i.start_position, i.num_tokens) for i in found] == [(0, 32)]
    assert reader.counted("lookups_waited") == 1 and reader.counted("lookup_waits_expired") == 1
    writer.close(), reader.close()
