"""The Redis segment store and the remote tier against a real redis-server on loopback.

Each test starts its own redis-server (tests/redis_server.py); they are skipped, with the reason, only
when redis-server is not installed. Two stores on one Redis stand for two replicas: the second never
saw the first's conversation and finds it by the prompt alone.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cairn.cache.remote.client import split_url
from cairn.cache.remote.finder import lookup
from cairn.cache.remote.keys import chain_keys, prefix_keys
from cairn.cache.remote.store import RedisSegmentStore
from cairn.cache.segments.named_bytes import layout_meta
from cairn.cache.segments.segment import FORMAT_VERSION, Segment, encode_segment, segment_key
from cairn.cache.segments.tier import SegmentTier
from cairn.cache.tiers.tier_set import TieredSnapshot
from cairn.cache.tree.nodes import DEVICE, REMOTE, Node, SnapshotEntry
from tests.server_process import free_port

NS = "ab" * 32
PAGE = 4


def make_store(url, **kw) -> RedisSegmentStore:
    kw = {"timeout_s": 2.0, "cooldown_s": 60.0, **kw}
    return RedisSegmentStore(url, NS, PAGE, **kw)


def chain(tokens, bounds, snapshot_at=()) -> list[Segment]:
    """Segments of `tokens` cut at bounds, with a snapshot (and logits) at each end in snapshot_at."""
    keys, parents = chain_keys(tokens, bounds), prefix_keys(tokens, bounds[1:-1])
    out = []
    for (start, stop), key in zip(zip(bounds, bounds[1:], strict=False), keys, strict=True):
        snap = stop in snapshot_at
        out.append(Segment(key, parents.get(start), start, tokens[start:stop], kv_bytes=bytes([stop % 251]) * 64,
                           snapshot_bytes=b"S" * 32 if snap else None, logits_bytes=b"L" * 8 if snap else None,
                           snapshot_meta=layout_meta([("state", "uint8", (32,))]) if snap else {}))
    return out


def put_all(store, segments) -> None:
    for s in segments:
        assert store.put(s)
    assert store.flush()


def test_a_segment_round_trips_as_the_exact_disk_format_bytes(redis_server):
    store = make_store(redis_server.url)
    tokens = list(range(10))
    (seg,) = chain(tokens, [0, 10], snapshot_at={10})
    put_all(store, [seg])
    raw = redis_server.client().get(store.names.segment(seg.key))
    assert raw == encode_segment(seg, NS)
    other = make_store(redis_server.url)
    assert other.lookup(tokens, [10])[0].key == seg.key
    got = other.get(seg.key)
    assert got.tokens == seg.tokens and bytes(got.kv_bytes) == seg.kv_bytes and bytes(got.snapshot_bytes) == b"S" * 32
    store.close(), other.close()


def test_another_replica_finds_the_deepest_snapshot_chain_by_the_prompt_alone(redis_server):
    writer = make_store(redis_server.url)
    tokens = list(range(100, 140))
    put_all(writer, chain(tokens, [0, 8, 21, 30], snapshot_at={8, 21}))  # 21 and 30: not page multiples
    reader = make_store(redis_server.url)
    prompt = tokens[:26] + [7, 7, 7]  # leaves the stored path at 26: the snapshot at 21 is the deepest usable
    infos = reader.lookup(prompt, range(PAGE, len(prompt) + 1, PAGE))
    assert [(i.start_position, i.num_tokens, i.has_snapshot) for i in infos] == [(0, 8, True), (8, 13, True)]
    assert reader.get_tokens(infos[1].key) == tuple(tokens[8:21])
    assert reader.get(infos[1].key).snapshot_bytes == b"S" * 32
    assert reader.lookup([1, 2, 3, 4, 5], [4, 5]) == []  # another conversation: a miss
    writer.close(), reader.close()


@pytest.mark.parametrize("garbage", [b"not json", b'{"v": 1}', "bounds", "unordered", "version",
                                     b"x" * ((1 << 20) + 1)])  # the last: past MAX_ENTRY_BYTES
def test_a_bad_index_entry_is_counted_deleted_and_the_lookup_falls_back_to_a_shallower_chain(redis_server, garbage):
    writer = make_store(redis_server.url)
    tokens = list(range(50, 66))
    put_all(writer, chain(tokens, [0, 8, 16], snapshot_at={8, 16}))
    name = writer.names.entry(prefix_keys(tokens, [16])[16])
    r = redis_server.client()
    edits = {"bounds": (b'"bounds":[0,8,16]', b'"bounds":[0,4,16]'),  # a chain that does not lead to its key
             "unordered": (b'"bounds":[0,8,16]', b'"bounds":[0,16,8]'), "version": (b'"v":1,', b'"v":99,')}
    if garbage in edits:  # valid JSON, not an entry of this build; else not JSON, or past MAX_ENTRY_BYTES
        garbage = r.get(name).replace(*edits[garbage])
    r.set(name, garbage)
    reader = make_store(redis_server.url)
    infos = reader.lookup(tokens, [8, 16])
    assert [(i.start_position, i.num_tokens) for i in infos] == [(0, 8)]
    assert reader.faults == {"bad_entry": 1} and r.get(name) is None
    writer.close(), reader.close()


def test_a_child_is_refused_when_its_parent_is_unknown_here(redis_server):
    store = make_store(redis_server.url)
    tokens = list(range(12))
    _, child = chain(tokens, [0, 4, 12])
    assert not store.put(child)
    assert store.faults == {"unknown_parent": 1}
    store.close()


@pytest.mark.parametrize("damage", ["flip", "version", "foreign", "swap"])
def test_a_bad_value_in_redis_is_never_returned_and_is_counted_and_deleted(redis_server, damage):
    writer = make_store(redis_server.url)
    tokens = list(range(16))
    a, b = chain(tokens, [0, 8, 16], snapshot_at={8, 16})
    put_all(writer, [a, b])
    r = redis_server.client()
    name = writer.names.segment(b.key)
    raw = bytearray(r.get(name))
    if damage == "flip":
        raw[len(raw) // 2] ^= 0xFF
    elif damage == "version":
        raw[8:10] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    elif damage == "foreign":
        raw = bytearray(encode_segment(b, "cd" * 32))
    else:
        raw = bytearray(r.get(writer.names.segment(a.key)))  # a valid segment under another key
    r.set(name, bytes(raw))
    evicted = []
    reader = make_store(redis_server.url, on_evict=evicted.append)
    assert len(reader.lookup(tokens, [8, 16])) == 2
    assert reader.get(b.key) is None
    reason = {"flip": "checksum", "version": "version", "foreign": "foreign_model", "swap": "malformed"}[damage]
    assert reader.faults == {reason: 1}
    assert evicted == [b.key] and reader.info(b.key) is None
    assert r.get(name) is None  # deleted from Redis
    assert reader.get(a.key).tokens == tuple(tokens[:8])  # the parent is fine
    writer.close(), reader.close()


def test_a_value_that_expired_or_was_evicted_is_a_miss(redis_server):
    store = make_store(redis_server.url, ttl_s=3600)
    tokens = list(range(8))
    (seg,) = chain(tokens, [0, 8], snapshot_at={8})
    put_all(store, [seg])
    r = redis_server.client()
    assert 0 < r.ttl(store.names.segment(seg.key)) <= 3600
    r.delete(store.names.segment(seg.key))  # what TTL expiry or maxmemory eviction does
    assert store.get(seg.key) is None
    assert store.faults == {"missing": 1} and store.info(seg.key) is None


def test_a_redis_that_is_down_is_a_miss_with_one_log_line_and_counted(redis_server, caplog):
    store = make_store(redis_server.url, timeout_s=0.5, cooldown_s=60.0)
    tokens = list(range(8))
    a, b = chain(tokens, [0, 4, 8], snapshot_at={8})
    put_all(store, [a])
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="cairn.cache.remote.client"):
        assert store.get(a.key) is None
        assert store.lookup(tokens, [4, 8]) == []
        assert store.put(b) is False
        assert store.get(a.key) is None
    assert store.faults["unavailable"] == 1 and store.faults["breaker_open"] == 3
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    assert store.redis.breaker.num_opened == 1
    store.close(timeout_s=1.0)


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_a_store_whose_redis_is_not_there_starts_and_every_call_is_a_miss(scheme):
    pytest.importorskip("redis")
    url = f"{scheme}://127.0.0.1:{free_port()}" + ("/0" if scheme == "redis" else "")
    store = RedisSegmentStore(url, NS, PAGE, timeout_s=0.5, cooldown_s=60.0)
    tokens = list(range(8))
    (seg,) = chain(tokens, [0, 8], snapshot_at={8})
    assert store.lookup(tokens, [8]) == []
    assert store.put(seg) is False and store.get(seg.key) is None
    assert store.faults == {"unavailable": 1, "breaker_open": 1}
    store.close(timeout_s=1.0)


def test_writes_beyond_the_queue_are_dropped_and_counted(redis_server):
    store = make_store(redis_server.url, queue_segments=1, timeout_s=10.0)
    blocker = redis_server.client()
    blocker.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # the writer's SET waits meanwhile
    segs = [chain([i, i + 1, i + 2, i + 3], [0, 4])[0] for i in range(0, 50, 10)]
    accepted = [store.put(s) for s in segs]
    assert sum(accepted) <= 2  # one in the writer's hands, one queued
    assert store.faults["queue_full"] == len(segs) - sum(accepted)
    assert store.flush(timeout_s=10.0)
    r = redis_server.client()
    assert [r.exists(store.names.segment(s.key)) == 1 for s in segs] == accepted
    store.close()


@pytest.mark.parametrize("url,plain,cluster", [
    ("redis://h:6379/2", "redis://h:6379/2", False),
    ("rediss://u:p@h:6380/0", "rediss://u:p@h:6380/0", False),
    ("redis+cluster://h:7000", "redis://h:7000", True),
    ("redis://h:7000?cluster=true&ssl_cert_reqs=none", "redis://h:7000?ssl_cert_reqs=none", True),
])
def test_url_forms(url, plain, cluster):
    assert split_url(url) == (plain, cluster)


def test_an_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="redis://"):
        split_url("http://h:6379")


def _path(tokens, cuts) -> list[Node]:
    nodes, parent = [], None
    for i, (start, stop) in enumerate(zip(cuts, cuts[1:], strict=False)):
        node = Node(i + 1, tuple(tokens[start:stop]), start, stop, parent,
                    {DEVICE: list(range(start // PAGE, -(-stop // PAGE)))})
        nodes.append(node)
        parent = node
    return nodes


class _Source:
    """The tier protocol's Source over a hand-built path: KV filled with each node's start, one state."""

    state = {"conv": torch.arange(6, dtype=torch.float32).reshape(2, 3), "recurrent": torch.ones(2, 2, 2)}

    def __init__(self):
        self.kv_reads = 0

    def node_kv(self, node):
        self.kv_reads += 1
        n = len(node.kv[DEVICE])
        return torch.full((2, n, PAGE, 1, 2), float(node.start)), torch.full((2, n, PAGE, 1, 2), -1.0)

    def node_snapshot(self, node):
        return (self.state, torch.arange(5.0) if node.end == 22 else None) if node.snapshot else None


def test_remote_tier_persists_a_path_and_another_replica_resumes_its_snapshot(redis_server):
    tokens = list(range(300, 322))
    path = _path(tokens, [0, 9, 22])
    path[0].snapshot = SnapshotEntry(8, "message", False, handle=TieredSnapshot(False))
    path[1].snapshot = SnapshotEntry(8, "prompt_end", True, handle=TieredSnapshot(True))
    source = _Source()
    writer = SegmentTier(make_store(redis_server.url), PAGE, name=REMOTE)
    assert writer.persist(path, source) == 2
    assert all(REMOTE in n.kv and REMOTE in n.snapshot.handle.copies for n in path)  # recorded on the tree
    assert writer.persist(path, source) == 0 and source.kv_reads == 2  # already there: nothing read again
    assert writer.store.flush()
    reader = SegmentTier(make_store(redis_server.url), PAGE, name=REMOTE)
    found = lookup(reader, tokens + [1, 2], message_starts=[9])
    assert [(len(p), start, snap, logits, salt) for p, start, _, snap, logits, salt in found] == \
        [(9, 0, True, False, None), (22, 9, True, True, None)]
    assert [(p, start, snap) for p, start, _, snap, *_ in reader.stored_paths()] == \
        [(p, start, snap) for p, start, _, snap, *_ in found]  # what the tree would be given, as the disk tier's
    other_path = _path(tokens, [0, 9, 22])  # the reader's own tree: what a lookup found is not written again
    for node in other_path:
        node.snapshot = SnapshotEntry(8, "grid", node.end == 22, handle=TieredSnapshot(node.end == 22))
    assert reader.persist(other_path, source) == 0 and source.kv_reads == 2
    tensors, logits = reader.read_snapshot(found[1][2].key)
    assert torch.equal(tensors["conv"], _Source.state["conv"]) and torch.equal(logits, torch.arange(5.0))
    k, v = reader.read_kv(other_path[1])
    assert k.shape == (2, 4, PAGE, 1, 2) and torch.all(k == 9.0) and torch.all(v == -1.0)
    assert found[1][2].key == segment_key(prefix_keys(tokens, [9])[9], tokens[9:22])
    writer.store.close(), reader.store.close()


def test_another_branchs_entry_at_a_shared_page_position_is_not_taken_for_this_prompts(redis_server):
    """Two conversations share their first 8 tokens and each ends with a snapshot at 10 (not a page multiple):
    the second's copy of its entry at the page below its end (8, with its tail) replaces the first's there,
    so a prompt of the first, probed at page multiples, finds an entry whose tail is not its own: not its
    chain, and not a bad entry either (nothing counted, nothing deleted); probed at its message start 10 too,
    it finds its own chain by the entry at the end."""
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    first, second = shared + [50, 51], shared + [60, 61]
    writer = make_store(redis_server.url)
    for tokens in (first, second):
        (segment,) = chain(tokens, [0, 10], snapshot_at={10})
        assert writer.put(segment)
    assert writer.flush()
    reader = make_store(redis_server.url)
    assert reader.lookup(first + [99], [4, 8]) == []
    assert [info.num_tokens for info in reader.lookup(second + [99], [4, 8])] == [10]
    assert [reader.get_tokens(info.key) for info in reader.lookup(first + [99], [4, 8, 10])] == [tuple(first)]
    assert reader.faults == {}
    writer.close()
    reader.close()
