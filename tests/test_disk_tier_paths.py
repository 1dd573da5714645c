"""The disk tier's failure paths on a real engine (demo model, fp32, greedy) and a real cache directory.

A store that refuses every write (a budget smaller than one segment), segments whose parent is gone at
start-up (orphans: never resumable, deleted by the writer), and a disk tier feeding the Redis tier
(segments read back from disk to be written to Redis): each request is still served as cold serves it,
and what happened is counted in the stats that /metrics exports (`cairn_cache_disk_operations_total{kind}`).

The races with another process: a segment lost from Redis or evicted from a shared disk while a request
resumed from it runs (its path cannot be copied to the other tier until the request's end), a writer
storing a path again without its snapshot, a rescan meeting snapshots this engine already holds. Each
change is a real one (a Redis DEL, an unlink, a put), made at the right moment by wrapping the call just
after it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from cairn.cache.base import CacheRequest
from cairn.cache.segments.index import MAX_UNREADABLE
from cairn.cache.tree.nodes import DISK, REMOTE, DiskRef
from cairn.engine.llm import LLM
from tests.harness import run, same_as_cold

OPTS = dict(kv_cache_gib=0.05, state_cache_gib=0.02, page_size=8, snapshot_interval=64, max_num_batched_tokens=96)
CONVERSATION = list(range(10, 250)) + list(range(10, 200))  # 430 tokens: grid snapshots at 64, 128, ..., 384


def cold_llm() -> LLM:
    return LLM(**OPTS, prefix_cache=False)


def operations(llm: LLM, tier: str = "disk") -> dict[str, int]:
    return getattr(llm.engine.cache.stats(), tier).operations


def test_a_disk_too_small_for_any_segment_fails_each_write_counted_and_serves_as_cold(tmp_path):
    with LLM(**OPTS, disk_cache=str(tmp_path), disk_cache_gib=4096 / 2**30) as llm:
        first = run(llm, CONVERSATION)
        ops = operations(llm)
        assert ops["write_failed"] >= 1 and "segments_written" not in ops
        assert llm.engine.cache.stats().disk.num_segments == 0
        assert all(DISK not in e.handle.copies for _, e, _ in llm.engine.cache.tree.iter_snapshots())
        prompt = CONVERSATION + first.token_ids + [5, 6]
        out = run(llm, prompt)  # the device tier still serves the next turn
        assert out.cache.resume_tier == "device" and out.cache.resume_position >= len(CONVERSATION)
        same_as_cold(cold_llm(), out, prompt)


def test_segments_whose_parent_is_gone_at_restart_are_counted_as_orphans_never_resumed_and_deleted(tmp_path):
    """The first segment of a conversation is gone (a crash, a corrupt file removed): every segment below it can
    never be resumed. A read-only engine counts them and leaves them; the namespace's writer counts them and
    deletes them (they took the budget and were scanned at every start), so the next start finds none."""
    with LLM(**OPTS, disk_cache=str(tmp_path)) as first:
        run(first, CONVERSATION)
        store = first.engine.cache.tiers.by_name["disk"].store
        keys = store.keys()
        (root_key,) = [k for k in keys if store.info(k).parent_key is None]
        namespace = Path(store.root) / store.compat_digest
        (namespace / (root_key.hex() + ".seg")).unlink()
        with LLM(**OPTS, disk_cache=str(tmp_path)) as reader:  # the first engine holds the lock
            assert operations(reader)["orphan_segments"] == len(keys) - 1
            assert len(list(namespace.glob("*.seg"))) == len(keys) - 1  # a read-only store deletes nothing
    with LLM(**OPTS, disk_cache=str(tmp_path)) as second:
        assert operations(second)["orphan_segments"] == len(keys) - 1  # every other segment chains to the root
        assert second.engine.cache.tree.num_nodes == 0  # nothing hung below the root
        assert not list(namespace.glob("*.seg")) and second.engine.cache.stats().disk.num_segments == 0
        out = run(second, CONVERSATION + [5, 6])
        assert out.cache.cached_tokens == 0
        same_as_cold(cold_llm(), out, CONVERSATION + [5, 6])
    with LLM(**OPTS, disk_cache=str(tmp_path)) as third:  # what the second wrote chains to the root again
        assert "orphan_segments" not in operations(third)


def test_a_conversation_indexed_from_disk_is_written_on_to_redis_and_resumed_there_as_cold(tmp_path, redis_server):
    with LLM(**OPTS, disk_cache=str(tmp_path)) as writer:
        reply = run(writer, CONVERSATION)
    prompt = CONVERSATION + reply.token_ids + [5, 6, 7]
    with LLM(**OPTS, disk_cache=str(tmp_path), remote_cache=redis_server.url) as both:
        remote = both.engine.cache.tiers.by_name[REMOTE]
        remote.store.redis.timeout_s = 5.0  # a loaded test machine: this checks what is found, not the breaker
        out = run(both, prompt)  # resumes from disk; its path, read back from the segments, goes to Redis too
        assert out.cache.resume_tier == DISK
        assert remote.store.flush()
        assert operations(both, "remote")["segments_written"] >= 2 and operations(both)["read_ok"] >= 1
    with LLM(**OPTS, remote_cache=redis_server.url) as reader:
        reader.engine.cache.tiers.by_name[REMOTE].store.redis.timeout_s = 5.0
        again = run(reader, prompt + [8])
        assert again.cache.resume_tier == REMOTE and again.cache.resume_position >= len(CONVERSATION)
        same_as_cold(cold_llm(), again, prompt + [8])


def test_a_conversation_leaving_a_stored_one_midway_is_resumed_from_disk_after_a_restart(tmp_path):
    """With exact resumption (--prefill-block, 512 tokens in bf16) no snapshot is taken where a prompt leaves a
    stored conversation inside a block, so the node above the split is a slice of a longer segment. A chain on
    disk continues only from a segment's end: the new conversation's segments chain to the slice's end, and
    without a segment ending there they were orphans at the next start (the remote tier's slice problem)."""
    aligned = dict(OPTS, prefill_block=64)
    with LLM(**aligned, disk_cache=str(tmp_path)) as first:
        run(first, CONVERSATION)  # written through as segments cut at its snapshots (64, 128, ...)
        other = CONVERSATION[:20] + list(range(200, 250)) * 8  # leaves it at 20, inside its first segment
        reply = run(first, other)
        assert operations(first)["slices_rewritten"] == 1
    prompt = other + reply.token_ids + [5, 6, 7]
    with LLM(**aligned, disk_cache=str(tmp_path)) as second:  # the same --disk-cache, nothing in memory
        assert "orphan_segments" not in operations(second)
        out = run(second, prompt)
        assert out.cache.resume_tier == DISK and out.cache.cached_tokens == len(other) // 64 * 64
        same_as_cold(cold_llm(), out, prompt)
        again = run(second, CONVERSATION + [5, 6])  # the stored conversation is still whole
        assert again.cache.resume_tier == DISK and again.cache.cached_tokens == len(CONVERSATION) // 64 * 64


def admit(llm: LLM, prompt: list[int]):
    """What the scheduler does to start a request: a working slot, then the cache's admission."""
    req = CacheRequest(prompt, llm.engine.states.alloc())
    return req, llm.engine.cache.admit(req)


def release(llm: LLM, req: CacheRequest, admission) -> None:
    """What the scheduler does when a request stops unfinished: the cache lets go, then its pages and slot."""
    view = CacheRequest(req.token_ids, req.state_slot, admission.page_table, admission.num_cached)
    llm.engine.cache.release(admission, view, finished=False)
    llm.engine.kv.allocator.decref(admission.page_table)
    llm.engine.states.free(req.state_slot)


def test_a_segment_found_bad_while_a_request_holds_it_is_planned_around_and_forgotten_once_released(tmp_path):
    """The race of two requests on one conversation: the first resumed from a snapshot whose only copy is a disk
    segment (its KV is on the device too) and holds it; the file is then damaged, and the second finds it bad.
    The second plans again without it (resuming from the snapshot above) while the first's record stays, locked;
    once the first lets go, the segment is forgotten (counted) and the device KV it covered stays."""
    slot_bytes = 430_080  # the demo model's state slot: three fit on the device, older snapshots go to disk
    with LLM(**OPTS, disk_cache=str(tmp_path), host_cache_gib=0, device_snapshot_gib=3.5 * slot_bytes / 2**30) as llm:
        run(llm, CONVERSATION)
        cache = llm.engine.cache
        cache.speeds.prefill_tokens_per_s = 1e-3  # the planner then always takes the deepest point it can
        cache.promote_resumed = False  # the snapshot's copy stays on disk alone
        prompt = CONVERSATION[:130] + [1, 2]
        first_req, first = admit(llm, prompt)
        node = cache.tree.match(prompt).resume_node
        assert first.num_cached == 128 and first.report.resume_tier == "disk" and set(node.kv) == {"device", "disk"}
        key = node.snapshot.handle.copies["disk"]
        store = cache.tiers.by_name["disk"].store
        os.truncate(Path(store.root) / store.compat_digest / f"{key.hex()}.seg", 100)
        second_req, second = admit(llm, prompt)
        assert second.num_cached == 64 and second.report.miss_reason == "corrupt"
        assert node.snapshot.handle.copies == {"disk": key} and "disk" in node.kv  # held by the first: kept
        assert not cache.stats().disk.forgotten
        release(llm, second_req, second)
        release(llm, first_req, first)
        assert cache.stats().disk.forgotten == {"disk_unreadable": 1}
        assert node.snapshot is None and set(node.kv) == {"device"} and cache.tree.match(prompt).match_len == 130
        llm.engine.check_integrity()


def test_a_read_only_cache_rescans_on_a_miss_and_resumes_what_the_writer_added_since(tmp_path):
    """A second engine on the same directory is read-only; a prompt it misses rescans the directory (at most every
    `rescan_interval_s`, here at every miss): a rescan finding nothing new leaves the tree as it was, and one
    after the writer stored a conversation hangs it, so its next turn resumes from disk (that it then equals
    cold is the disk tier's tests' concern)."""
    with LLM(**OPTS, disk_cache=str(tmp_path)) as writer, LLM(**OPTS, disk_cache=str(tmp_path)) as reader:
        cache = reader.engine.cache
        assert cache.tiers.by_name[DISK].store.readonly
        cache.indexes[DISK].rescan_interval_s = 0.0
        assert run(reader, [7, 8, 9] * 20).cache.cached_tokens == 0  # nothing on disk yet: the rescan finds nothing
        assert cache.tree.num_snapshots >= 1 and all(DISK not in n.kv for n in cache.tree.iter_nodes())
        run(writer, CONVERSATION[:140])  # segments with snapshots at 64 and 128 (grid) and 140 (prompt end)
        out = run(reader, CONVERSATION[:140] + [5, 6])
        assert out.cache.resume_tier == DISK and out.cache.resume_position == 140



def test_a_read_only_cache_takes_the_lock_once_its_writer_is_gone_and_writes_from_then_on(tmp_path):
    """A rolling restart: the new engine starts beside the old one (read-only: the old one holds the lock), then the
    old one stops. The new one's next miss takes the lock, so what it computes from then on is written to disk and
    is resumed there after its own restart (it stayed read-only until restarted: nothing it served was kept)."""
    writer = LLM(**OPTS, disk_cache=str(tmp_path))
    with LLM(**OPTS, disk_cache=str(tmp_path)) as reader:
        store = reader.engine.cache.tiers.by_name[DISK].store
        assert store.readonly
        reader.engine.cache.indexes[DISK].rescan_interval_s = 0.0
        writer.close()
        run(reader, CONVERSATION[:140])
        assert not store.readonly and operations(reader)["segments_written"] >= 1
    with LLM(**OPTS, disk_cache=str(tmp_path)) as after:
        out = run(after, CONVERSATION[:140] + [5, 6])
        assert out.cache.resume_tier == DISK and out.cache.resume_position == 140

def test_a_read_only_caches_probe_rescans_as_its_admission_would(tmp_path):
    """The probe (what `cairn router` ranks replicas by) skipped the rescan: a read-only replica answered 0 for a
    prompt it then resumed deep from disk, and the router sent its requests elsewhere."""
    with LLM(**OPTS, disk_cache=str(tmp_path)) as writer, LLM(**OPTS, disk_cache=str(tmp_path)) as reader:
        cache = reader.engine.cache
        cache.indexes[DISK].rescan_interval_s = 0.0
        run(writer, CONVERSATION[:140])
        probed = cache.probe(CONVERSATION[:140] + [5, 6])
        assert (probed.position, probed.tier) == (140, DISK)


def test_the_keys_remembered_as_unreadable_are_bounded_and_forgotten_all_at_once(tmp_path):
    """A lookup never hangs a segment marked unreadable again (a shared store's index may outlive the file); the
    marks are bounded: the one past MAX_UNREADABLE clears them, so the oldest can be hung (and found bad) again."""
    with LLM(**OPTS, disk_cache=str(tmp_path)) as llm:
        index = llm.engine.cache.indexes[DISK]
        keys = [i.to_bytes(32, "little") for i in range(MAX_UNREADABLE + 1)]
        for key in keys:
            index.mark_bad(key)
        index.forget()  # as admission does first: none of them is on the tree
        first, last = ((tuple(range(t, t + 8)), 0, DiskRef(k, 0, 8), False, False, None)  # unsalted
                       for t, k in ((1, keys[0]), (100, keys[-1])))
        assert not index.hang_found([last])  # the newest mark is kept
        assert index.hang_found([first]) and DISK in llm.engine.cache.tree.match(first[0]).path[0].kv


ONE_DEVICE_SNAPSHOT_GIB = 1.5 * 430_080 / 2**30  # one of the demo model's state slots: a second capture demotes
SIX_SNAPSHOTS_GIB = 6.5 * 430_080 / 2**30


def before_first_call(monkeypatch, obj, name: str, change) -> None:
    """Run change() (another process's move) just before the first call of obj.name, then the call itself."""
    real = getattr(obj, name)

    def changed_first(*args, **kwargs):
        monkeypatch.setattr(obj, name, real)  # once
        change()
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, changed_first)


def returns_of(monkeypatch, obj, name: str) -> list:
    """What every later call of obj.name returns, in order."""
    real, returned = getattr(obj, name), []

    def recorded(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(obj, name, recorded)
    return returned


def test_a_path_whose_first_segment_redis_lost_mid_request_is_not_copied_to_disk_until_the_end(
        tmp_path, redis_server, monkeypatch):
    """A request resumes a conversation found in Redis; while it runs, Redis loses the first segment of that path
    (maxmemory eviction, a TTL, another replica's flush). The device holds one snapshot, so the request's second
    capture demotes its first to disk, whose segment needs the whole path above it: the first node's KV is only in
    Redis, now unreadable, so nothing is written (counted), to Redis either: its store forgot the lost segment with
    the ones chained below it, so no child of a vanished parent (a chain nobody can resume) is sent. At the
    request's end the path is written whole, to disk and to Redis, from the request's own pages, without the
    snapshot at 64, whose only copy was in that segment (nor the ones its captures took on the way, which had
    nowhere to go: the device holds one); the lost segment is forgotten, and a restart on the disk alone resumes the
    conversation's next turn from the request's end as cold serves it."""
    with LLM(**OPTS, remote_cache=redis_server.url) as writer:
        writer.engine.cache.tiers.by_name[REMOTE].store.redis.timeout_s = 5.0
        run(writer, CONVERSATION[:140])
        assert writer.engine.cache.tiers.by_name[REMOTE].store.flush()
    with LLM(**OPTS, disk_cache=str(tmp_path), remote_cache=redis_server.url, host_cache_gib=0,
             device_snapshot_gib=ONE_DEVICE_SNAPSHOT_GIB) as llm:
        cache = llm.engine.cache
        remote, disk = cache.tiers.by_name[REMOTE], cache.tiers.by_name[DISK]
        remote.store.redis.timeout_s = 5.0
        cache.promote_resumed = False  # the resumed path's KV stays in Redis alone
        lost = []

        def redis_loses_the_first_segment():
            (first,) = cache.tree.root.children.values()
            lost.append(first.kv[REMOTE].key)
            assert redis_server.client().delete(remote.store.names.segment(lost[0])) == 1

        before_first_call(monkeypatch, disk, "store_snapshot", redis_loses_the_first_segment)
        out = run(llm, CONVERSATION)
        assert out.cache.resume_tier == REMOTE and out.cache.resume_position == 140 and lost
        same_as_cold(cold_llm(), out, CONVERSATION)
        demoted = cache.tiers.moved["snapshot device->remote"]
        tried = operations(llm)["write_unreadable"]
        assert demoted == 0 and tried >= 1 and operations(llm, "remote")["write_unreadable"] == tried
        assert operations(llm, "remote")["read_vanished"] == 1 and operations(llm, "remote")["read_missing"] >= 1
        assert cache.stats().remote.faults == {"missing": 1}  # no unknown_parent: nothing was sent below the loss
        assert cache.stats().remote.forgotten == {"remote_evicted": 3}  # the lost segment and the two chained below
        assert operations(llm, "remote")["segments_written"] == operations(llm, "remote")["segments_queued"] >= 3
        first = cache.tree.match(CONVERSATION).path[0]
        assert set(first.kv) == {DISK} and first.snapshot is None  # the snapshot at 64 went with the segment
        assert disk.store.info(lost[0]).has_snapshot is False  # (equal paths, equal keys: disk's is the same)
        following = CONVERSATION + out.token_ids + [5, 6]
    with LLM(**OPTS, disk_cache=str(tmp_path)) as restarted:
        again = run(restarted, following)
        assert again.cache.resume_tier == DISK and again.cache.resume_position > len(CONVERSATION)
        same_as_cold(cold_llm(), again, following)


def test_a_segment_evicted_from_a_shared_disk_while_its_path_is_copied_to_redis_stops_the_copy_there(
        tmp_path, redis_server, monkeypatch):
    """Another server manages the disk cache (this one's is read-only) and evicts the first segment of a path a
    request here resumed from it, while that request runs. The device holds one snapshot, so the request's second
    capture demotes its first: the disk refuses it (read-only), and Redis needs the whole path above it, whose
    first node's KV was only in that segment: nothing is queued (counted), not even the nodes below it, which
    Redis could not chain to. At the request's end the path goes to Redis from the request's own pages; the
    evicted segment is forgotten, and another replica resumes the conversation from Redis as cold serves it."""
    with LLM(**OPTS, disk_cache=str(tmp_path)) as writer:  # holds the namespace's lock while the test runs
        run(writer, CONVERSATION[:140])
        with LLM(**OPTS, disk_cache=str(tmp_path), remote_cache=redis_server.url, host_cache_gib=0,
                 device_snapshot_gib=ONE_DEVICE_SNAPSHOT_GIB) as llm:
            cache = llm.engine.cache
            remote, disk = cache.tiers.by_name[REMOTE], cache.tiers.by_name[DISK]
            remote.store.redis.timeout_s = 5.0
            assert disk.store.readonly
            cache.promote_resumed = False  # the resumed path's KV stays on the disk alone
            evicted = []

            def the_writer_evicts_the_first_segment():
                (first,) = cache.tree.root.children.values()
                evicted.append(first.kv[DISK].key)
                (Path(disk.store.root) / disk.store.compat_digest / f"{evicted[0].hex()}.seg").unlink()

            before_first_call(monkeypatch, remote, "store_snapshot", the_writer_evicts_the_first_segment)
            queued = returns_of(monkeypatch, remote, "persist")
            out = run(llm, CONVERSATION)
            assert out.cache.resume_tier == DISK and out.cache.resume_position == 140 and evicted
            same_as_cold(cold_llm(), out, CONVERSATION)
            *demotions, at_the_end = queued
            lost = cache.tiers.dropped["snapshot_device_full"]
            assert demotions == [0] * lost and lost >= 1 and at_the_end >= 4
            assert operations(llm, "remote")["write_unreadable"] == lost and operations(llm)["read_missing"] >= 1
            assert cache.stats().disk.faults["missing"] == 1 and cache.stats().disk.forgotten == {"disk_evicted": 1}
            assert set(cache.tree.match(CONVERSATION).path[0].kv) == {REMOTE}
            assert remote.store.flush()
    prompt = CONVERSATION + out.token_ids + [5, 6]  # the next turn (the request's end is its deepest snapshot)
    with LLM(**OPTS, remote_cache=redis_server.url) as other:
        other.engine.cache.tiers.by_name[REMOTE].store.redis.timeout_s = 5.0
        again = run(other, prompt)
        assert again.cache.resume_tier == REMOTE and again.cache.resume_position > len(CONVERSATION)
        same_as_cold(cold_llm(), again, prompt)


def snapshot_copies(llm: LLM, prompt: list[int]) -> dict[int, set[str]]:
    """Position -> the tiers holding a copy, for each snapshot on prompt's path."""
    return {node.end: set(node.snapshot.handle.copies) for node in llm.engine.cache.tree.match(prompt).path
            if node.snapshot is not None}


def test_a_snapshot_held_here_that_the_writer_stores_too_gets_its_disk_copy_at_the_rescan(tmp_path):
    """A read-only engine and the writer of its cache serve the same conversation; the rescan (a miss) finds the
    writer's segments ending where this engine already holds snapshots on the device, and records their disk copy
    on them. When the device later lets them go, they stay resumable from disk (this engine cannot write them)."""
    prompt = CONVERSATION[:140]
    with LLM(**OPTS, disk_cache=str(tmp_path)) as writer, \
            LLM(**OPTS, disk_cache=str(tmp_path), host_cache_gib=0, device_snapshot_gib=SIX_SNAPSHOTS_GIB) as reader:
        reader.engine.cache.indexes[DISK].rescan_interval_s = 0.0
        run(reader, prompt)  # device snapshots at 64 and 128 (grid) and 140 (the prompt's end, with logits)
        assert snapshot_copies(reader, prompt) == {64: {"device"}, 128: {"device"}, 140: {"device"}}
        run(writer, prompt)
        assert run(reader, prompt + [5, 6]).cache.resume_tier == "device"  # a miss past 140: the rescan
        assert snapshot_copies(reader, prompt) == {64: {"device", DISK}, 128: {"device", DISK}, 140: {"device", DISK}}
        run(reader, list(range(255, 15, -1)))  # another conversation's snapshots push these off the device
        assert snapshot_copies(reader, prompt) == {64: {DISK}, 128: {DISK}, 140: {DISK}}  # (the others dropped)
        assert reader.engine.cache.tiers.dropped["snapshot_device_full"] >= 1
        out = run(reader, prompt + [7, 8])
        assert out.cache.resume_tier == DISK and out.cache.resume_position == 140
        same_as_cold(cold_llm(), out, prompt + [7, 8])


def test_a_segment_the_writer_stored_again_without_its_snapshot_is_planned_around_and_forgotten(tmp_path):
    """Segment keys name a path, not what a file holds: the writer of a shared cache evicts a segment ending in a
    snapshot and later writes the same path again without one (its own snapshot there is gone). A read-only engine
    that indexed the first file plans a resume from its snapshot, reads a whole, valid segment without one, marks
    it bad and plans again from the snapshot above: served as cold; the segment is forgotten."""
    prompt = CONVERSATION[:140]
    with LLM(**OPTS, disk_cache=str(tmp_path)) as writer:
        run(writer, prompt)
        with LLM(**OPTS, disk_cache=str(tmp_path)) as reader:  # read-only; indexes the writer's segments at start-up
            cache = reader.engine.cache
            cache.indexes[DISK].rescan_interval_s = 1e9  # none later (it would not undo the plan either)
            key = cache.tree.match(prompt).path[-1].snapshot.handle.copies[DISK]  # the segment ending at 140
            store = writer.engine.cache.tiers.by_name[DISK].store
            stored = store.get(key)
            (Path(store.root) / store.compat_digest / f"{key.hex()}.seg").unlink()  # the writer's eviction of it...
            store.scan()
            assert store.put(dataclasses.replace(stored, snapshot_bytes=None, snapshot_meta={}, logits_bytes=None,
                                                 logits_meta={}))  # ... and a later write of that path without one
            out = run(reader, prompt + [5, 6])
            assert out.cache.miss_reason == "corrupt"
            assert out.cache.resume_tier == DISK and out.cache.resume_position == 128
            same_as_cold(cold_llm(), out, prompt + [5, 6])
            assert operations(reader)["read_ok"] >= 2 and "read_bad" not in operations(reader)  # whole, valid segments
            assert cache.stats().disk.forgotten == {"disk_unreadable": 1}
            assert cache.stats().disk.faults == {"readonly": 1}  # (its write at the request's end): no bad file


def test_a_resume_from_disk_keeps_its_segments_while_making_room_for_their_pages(tmp_path):
    """The device's KV pool holds about one and a half conversations, the disk about one conversation's segments,
    and only evictions write to disk. The first conversation goes to disk when the second needs the device;
    resuming the first then needs device pages for what it reads from disk, and making room demotes the second
    to disk, whose budget eviction took the least recently used segments: the very ones the resume was about to
    read (it found them missing, reported "corrupt" and resumed at 64). They are held while the resume makes
    room and loads, so it resumes where it planned, reading them."""
    pages = 30  # the demo model's KV page is 16 KiB: 30 pages hold one 140-token conversation and a half
    first, second = list(range(10, 150)), list(range(250, 110, -1))
    with LLM(**dict(OPTS, kv_cache_gib=pages * 16384 / 2**30), disk_cache=str(tmp_path), disk_cache_gib=2 / 1024,
             host_cache_gib=0, disk_write_through=False) as llm:
        run(llm, first)
        run(llm, second)
        cache = llm.engine.cache
        assert cache.tiers.moved["kv device->disk"] == 1 and DISK in cache.tree.match(first).path[0].kv
        out = run(llm, first + [5, 6])
        assert out.cache.resume_position == len(first) and out.cache.miss_reason is None
        assert operations(llm)["read_ok"] >= 1 and "read_missing" not in operations(llm)  # its pages, from disk
        assert cache.tiers.moved["kv device->disk"] == 2  # the second conversation went to disk meanwhile
        same_as_cold(cold_llm(), out, first + [5, 6])


def test_a_request_aborted_after_its_prefill_is_written_through_and_resumed_from_disk_after_a_restart(tmp_path):
    """A client that cancels a stream (499) or a shutdown that aborts one: the request's snapshots were taken by
    steps that completed, so they are written through as a finished request's are. Before, only finished requests
    were: an aborted one's snapshots stayed on the device, and after a restart its prompt was prefilled cold."""
    from cairn.request.sampling_params import SamplingParams

    with LLM(**OPTS, disk_cache=str(tmp_path)) as first:
        engine = first.engine
        engine.add_request(CONVERSATION, SamplingParams(max_tokens=200, ignore_eos=True), request_id="cancelled")
        while not any(out.delta_token_ids for out in engine.step()):  # prefill, to its first token
            pass
        engine.step()
        engine.abort("cancelled")
        engine.check_integrity()
        assert operations(first).get("segments_written", 0) > 0, operations(first)
    with LLM(**OPTS, disk_cache=str(tmp_path)) as second:
        prompt = CONVERSATION + [5, 6]
        out = run(second, prompt)
        assert out.cache.resume_tier == DISK and out.cache.cached_tokens == len(CONVERSATION)
        same_as_cold(cold_llm(), out, prompt)


def test_segments_below_one_found_bad_are_resumed_again_once_a_request_has_written_it_again(tmp_path):
    """A bad segment is forgotten with every segment below it (they chain through it). The next request over it
    recomputes it and writes it again under the same key; the intact segments below it are hung on the tree again
    then, so a request on the stored conversation resumes from them, not only after a restart."""
    with LLM(**OPTS, disk_cache=str(tmp_path)) as first:
        run(first, CONVERSATION)
    with LLM(**OPTS, disk_cache=str(tmp_path)) as second:  # everything on disk alone
        store = second.engine.cache.tiers.by_name["disk"].store
        (root_key,) = [k for k in store.keys() if store.info(k).parent_key is None]  # noqa: SIM118 (a store)
        flip = Path(store.root) / store.compat_digest / (root_key.hex() + ".seg")
        data = bytearray(flip.read_bytes())
        data[len(data) // 2] ^= 1
        flip.write_bytes(bytes(data))
        branch = CONVERSATION[:100] + [7] * 20
        assert run(second, branch).cache.cached_tokens == 0  # found bad: cold, and [0, 64) written again
        assert store.info(root_key) is not None
        prompt = CONVERSATION + [5, 6]
        out = run(second, prompt)
        assert out.cache.resume_tier == DISK and out.cache.cached_tokens == len(CONVERSATION)
        same_as_cold(cold_llm(), out, prompt)


def segments_add_up(llm: LLM) -> dict[str, int]:
    """The disk store's exported counts, checked against the segments it indexes (cairn_cache_num_disk_segments)."""
    disk = llm.engine.cache.stats().disk
    c = disk.store_segments
    assert disk.num_segments == c["scanned"] + c["puts"] - c["rewrites"] - c["evictions"] - c["removed"] - c["dropped"]
    return c


def test_the_exported_store_counts_add_up_to_the_disk_segments_across_evictions_and_a_restart(tmp_path):
    """What /metrics exports lets an operator account for every segment indexed: written, rewritten, evicted for
    the budget, found at start-up (the counts a server reported were compared and did not add up)."""
    budget_gib = 3 * 2**20 / 2**30
    with LLM(**OPTS, disk_cache=str(tmp_path), disk_cache_gib=budget_gib) as first:
        for shift in range(3):
            run(first, [t + shift for t in CONVERSATION])
        assert segments_add_up(first)["evictions"] > 0
    with LLM(**OPTS, disk_cache=str(tmp_path), disk_cache_gib=budget_gib) as second:
        assert segments_add_up(second)["scanned"] > 0
        run(second, CONVERSATION[:300])
        segments_add_up(second)
