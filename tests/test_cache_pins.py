"""A client's cache breakpoint keeps its snapshot for its TTL (policy/pins.py): on a full tier the unpinned
snapshots go first, the pins the tier holds last and soonest-expiring first, within --breakpoint-pin-share of
its budget; an expired pin falls back to ordinary retention, and /metrics counts pinned bytes and expiries."""

from __future__ import annotations

import pytest

from cairn.cache.policy.pins import held_pins, pin
from cairn.cache.tree.nodes import DEVICE, SnapshotEntry
from cairn.config import CacheOptions, ConfigError
from cairn.engine.llm import LLM
from cairn.request.prompt import Breakpoint, TokenizedPrompt
from cairn.request.sampling_params import SamplingParams
from cairn.server.metrics import cache_families
from tests.tiny_tiers import TinyCache

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
MARKED = [(5 * j + 1) % 250 for j in range(64)]  # the client marks the block ending at 32
DEVICE_SNAPSHOTS = 6  # the device tier's budget, in snapshots with logits


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def small_llm(pin_share: float = 0.5) -> tuple[LLM, Clock]:
    """The demo engine with room for DEVICE_SNAPSHOTS snapshots on the device, no host tier, and a clock of the
    test's for the pins."""
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              snapshot_interval=16, host_cache_gib=0, breakpoint_pin_share=pin_share)
    tiers = llm.engine.cache.tiers
    tiers.device.budget_bytes = DEVICE_SNAPSHOTS * tiers.device.snapshot_bytes(True)
    clock = tiers.clock = Clock()
    return llm, clock


def run(llm: LLM, tokens: list[int], *breakpoints: tuple[int, int]) -> None:
    """One request of `tokens` with these (position, ttl_s) breakpoints, to its end."""
    prompt = TokenizedPrompt(list(tokens), breakpoints=[Breakpoint(p, ttl) for p, ttl in breakpoints])
    llm._run(llm._add_all([prompt], lambda p: llm.engine.add_request(p, GREEDY)))


def pressure(llm: LLM, count: int = 4, length: int = 40) -> None:
    """Unrelated prompts, each leaving three or four snapshots: more than the device holds."""
    for i in range(count):
        run(llm, [(7 * j + 3 * i + 2) % 250 for j in range(length)])


def snapshot_at(llm: LLM, tokens: list[int], position: int) -> SnapshotEntry | None:
    """The snapshot the tree holds at `position` on the path of `tokens`, if any."""
    for end, entry, node in llm.engine.cache.tree.iter_snapshots():
        path: list[int] = []
        while node is not None:
            path[:0] = node.tokens
            node = node.parent
        if end == position and path == tokens[:position]:
            return entry
    return None


@pytest.mark.parametrize("pin_share, kept", [(0.5, True), (0.0, False)])
def test_a_breakpoints_snapshot_outlasts_the_unmarked_ones_while_its_pin_holds(pin_share, kept):
    """The marked conversation is the least recently used: without the pin its snapshot at the breakpoint goes
    with the others; with it, it stays on the device while the unmarked snapshots along the same path go."""
    llm, _ = small_llm(pin_share)
    run(llm, MARKED, (32, 300))
    pressure(llm)
    entry = snapshot_at(llm, MARKED, 32)
    assert (entry is not None and DEVICE in entry.handle.copies) == kept
    assert snapshot_at(llm, MARKED, 16) is None and snapshot_at(llm, MARKED, 48) is None  # unmarked: gone
    llm.engine.check_integrity()


def test_an_expired_pin_falls_back_to_ordinary_retention_and_is_not_dropped_at_once():
    llm, clock = small_llm()
    run(llm, MARKED, (32, 300))
    clock.now += 301
    stats = llm.engine.cache_stats()
    assert stats.pins["expired"] == 1 and stats.pinned_bytes[DEVICE] == 0
    entry = snapshot_at(llm, MARKED, 32)
    assert entry is not None and entry.pinned_until == 0  # still there, as any snapshot
    pressure(llm)
    assert snapshot_at(llm, MARKED, 32) is None  # then it goes as the least recently used one
    llm.engine.check_integrity()


def test_a_request_that_reads_a_marked_prefix_again_extends_its_pin():
    llm, clock = small_llm()
    run(llm, MARKED, (32, 300))
    assert snapshot_at(llm, MARKED, 32).pinned_until == 1300
    clock.now += 200
    run(llm, MARKED + [3, 4, 5], (32, 300))  # the next turn: the same marked block, resumed past it
    assert snapshot_at(llm, MARKED, 32).pinned_until == 1500
    assert llm.engine.cache_stats().pins["refreshed"] == 1
    clock.now += 250  # past the first pin's end, inside the refreshed one
    pressure(llm)
    assert snapshot_at(llm, MARKED, 32) is not None


def test_when_the_pins_overflow_their_share_the_soonest_expiring_one_goes_first():
    """Room for one pin: the hour-long one, marked first (the least recent), is kept; the five-minute one
    counts as unpinned and goes under pressure, though it was used last."""
    llm, _ = small_llm()
    tiers = llm.engine.cache.tiers
    tiers.pin_share = 1.5 * tiers.device.snapshot_bytes(False) / tiers.device.budget_bytes
    other = [(11 * j + 4) % 250 for j in range(64)]
    run(llm, MARKED, (32, 3600))
    run(llm, other, (32, 300))
    assert tiers.pinned_bytes() == {DEVICE: tiers.device.snapshot_bytes(False)}
    pressure(llm)
    assert snapshot_at(llm, MARKED, 32) is not None and snapshot_at(llm, other, 32) is None
    llm.engine.check_integrity()


def test_the_pins_a_tier_holds_go_last_and_soonest_expiring_first():
    cache = TinyCache(device_slots=4)
    cache.tiers.pin_share, cache.tiers.clock = 1.0, lambda: 0.0
    table = cache.alloc.alloc(4)
    for end, label in ((4, "a"), (8, "b"), (12, "c"), (16, "d")):
        assert cache.attach(list(range(end)), table, label)
    by_label = {cache.label(e): e for _, e, _ in cache.tree.iter_snapshots()}
    pin(by_label["a"], 600, 0.0)
    pin(by_label["c"], 300, 0.0)
    order = [cache.make_room()[0] for _ in range(4)]
    assert order[:2] == ["b", "d"] or order[:2] == ["d", "b"]  # the unpinned, in retention order
    assert order[2:] == ["c", "a"]  # then the pins, soonest-expiring first
    assert cache.tiers.pins["demoted"] == 2
    cache.alloc.decref(table)
    cache.check()


def test_held_pins_are_the_latest_expiring_that_fit_the_budget():
    entries = [SnapshotEntry(10, "breakpoint", False, pinned_until=t) for t in (5.0, 50.0, 20.0, 0.0, 1.0)]
    held = held_pins(entries, budget_bytes=25, now=2.0)  # 1.0 has expired; 0.0 was never pinned
    assert [e.pinned_until for e in held] == [20.0, 50.0]  # soonest-expiring first; 5.0 left out
    assert held_pins(entries, budget_bytes=0, now=2.0) == []


def test_metrics_count_pinned_bytes_per_tier_and_pin_events():
    llm, clock = small_llm()
    run(llm, MARKED, (32, 300))
    families = {f.name: f for f in cache_families(llm.engine.cache_stats())}
    [pinned] = [s for s in families["cairn_cache_pinned_bytes"].samples if s.labels == {"tier": DEVICE}]
    assert pinned.value == llm.engine.cache.tiers.device.snapshot_bytes(False)
    clock.now += 301
    families = {f.name: f for f in cache_families(llm.engine.cache_stats())}
    events = {s.labels["event"]: s.value for s in families["cairn_cache_pins"].samples if s.name.endswith("_total")}
    assert events == {"pinned": 1, "expired": 1}


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_pin_share_outside_zero_to_one_is_refused_naming_the_flag(share):
    with pytest.raises(ConfigError, match="--breakpoint-pin-share"):
        CacheOptions(breakpoint_pin_share=share)


def test_a_pin_the_device_cannot_hold_moves_to_the_host_and_is_held_there():
    """The share of the device's budget holds no whole snapshot, the host's holds two: the marked snapshot leaves
    the device as any other, and on the host it outlasts the unmarked ones."""
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              snapshot_interval=16, host_cache_gib=0.05)
    tiers = llm.engine.cache.tiers
    size = tiers.device.snapshot_bytes(True)
    host = tiers.by_name["host"]
    tiers.device.budget_bytes, host.budget_bytes = DEVICE_SNAPSHOTS * size, 20 * size
    tiers.pin_share, tiers.clock = 0.1, Clock()
    run(llm, MARKED, (32, 300))
    pressure(llm, count=10)
    entry = snapshot_at(llm, MARKED, 32)
    assert entry is not None and list(entry.handle.copies) == ["host"]
    assert snapshot_at(llm, MARKED, 16) is None and tiers.pinned_bytes() == {DEVICE: 0, "host": entry.nbytes}
    llm.engine.check_integrity()
