"""The two stores of segments implement SegmentStore (cairn/cache/segments/store.py), the protocol the one segment
tier is written over: every member it names, but what their kind exempts them from."""

from __future__ import annotations

import pytest

from cairn.cache.disk.store import DiskStore
from cairn.cache.remote.store import RedisSegmentStore
from cairn.cache.segments.store import SegmentStore


def protocol_members() -> set[str]:
    methods = {name for name, value in vars(SegmentStore).items() if callable(value) and not name.startswith("_")}
    return methods | set(SegmentStore.__annotations__) | {"__len__"}


@pytest.mark.parametrize("store", [DiskStore, RedisSegmentStore])
def test_each_store_has_every_member_of_the_protocol_but_remove_unreachable_when_shared(store):
    exempt = {"remove_unreachable"} if store.shared else set()
    instance_attributes = {"on_evict", "faults"}  # may be set in __init__ (on_evict: the index sets it afterwards)
    missing = {m for m in protocol_members() - exempt - instance_attributes if not hasattr(store, m)}
    assert not missing, f"{store.__name__} lacks {sorted(missing)}"


def test_the_disk_store_is_neither_shared_nor_write_behind_and_the_redis_store_is_both():
    assert (DiskStore.shared, DiskStore.write_behind) == (False, False)
    assert (RedisSegmentStore.shared, RedisSegmentStore.write_behind, RedisSegmentStore.readonly) == (True, True, False)
