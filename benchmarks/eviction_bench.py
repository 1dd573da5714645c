"""Eviction time on a large radix tree: the victim scan before issue 11 against the heap-based victim queues.

Builds, on CPU, a real cache in miniature (TierSet over tiny KV and state pools, device tier only)
holding `--conversations` x `--turns` nodes, one page and one snapshot per node, every conversation
sharing a 32-token system prompt. Then, on identical fresh trees, alternating:

    kv before     `--kv-victims` device KV victims, each found by a scan of every node (the old
                  TieredRadixTree.kv_victim, copied below as `scan_kv_victim`), dropped with drop_kv
    kv after      TierSet.free_device_pages(pages of those victims): one KVVictims heap per call
    snap before   `--snapshot-victims` snapshot victims, each by re-ranking the whole tree (the old
                  TieredRadixTree.snapshot_victim and policy/retention.rank_snapshots, copied below
                  as `rank_snapshot_victim` and `rank_snapshots`), demoted
    snap after    the same number popped from one SnapshotVictims queue (as _make_snapshot_room does)
    one snapshot  a call that needs a single victim (the common case): old rank + min against a queue

Both sides pick the same victims (checked). Prints a Markdown table; figures measured while other
work shares the machine are noisy, the ratio less so.

    python benchmarks/eviction_bench.py --conversations 2000 --turns 50
"""

from __future__ import annotations

import argparse
import platform
import time
from fractions import Fraction

import torch

from cairn.cache.hybrid import HybridPrefixCache
from cairn.cache.policy.placement import PlacementOptions
from cairn.cache.policy.retention import RetentionKey
from cairn.cache.tiers.pools import DeviceTier
from cairn.cache.tiers.tier_set import TierSet
from cairn.cache.tree.nodes import DEVICE, SnapshotEntry
from cairn.cache.tree.tiered import SnapshotVictims
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import LayerState, StateSpec, StateTensor

PAGE = 4


# ---- "before": the victim choice as it was, one full scan per victim -----------------------------

def scan_kv_victim(tree, tier: str):
    best = None
    for node in tree.iter_nodes():
        if node.lock_count or not tree.holds(node, tier):
            continue
        if any(tree.holds(child, tier) for child in node.children.values()):
            continue
        if best is None or (node.last_access, -node.end, node.node_id) < (best.last_access, -best.end, best.node_id):
            best = node
    return best


def rank_snapshots(root, eligible=None) -> list:
    """(key, node) for every unlocked snapshot under `root` (that `eligible` accepts), unordered. Pure.

    Gaps and `deepest` count every snapshot, eligible or not: with tiers, a snapshot on a slower tier
    still saves prefill for the one below it.

    Walks the tree iteratively (paths can be thousands of nodes deep), so it is O(number of nodes).
    """
    order = _preorder_with_ancestor_snapshot(root)
    has_snapshot_below = _snapshot_below(order)
    ranked = []
    for node, ancestor_position in order:
        entry = node.snapshot
        if entry is None or entry.lock_count > 0 or (eligible is not None and not eligible(entry)):
            continue
        key = RetentionKey(
            last_access=entry.last_access,
            deepest=not has_snapshot_below[id(node)],
            gap_per_byte=Fraction(node.end - ancestor_position, entry.nbytes),
            position=node.end,
        )
        ranked.append((key, node))
    return ranked


def _preorder_with_ancestor_snapshot(root) -> list:
    """Nodes below root in pre-order, each with the position of the nearest snapshot strictly above it."""
    order: list = []
    stack = [(child, 0) for child in root.children.values()]
    while stack:
        node, ancestor_position = stack.pop()
        order.append((node, ancestor_position))
        below_position = node.end if node.snapshot is not None else ancestor_position
        stack.extend((child, below_position) for child in node.children.values())
    return order


def _snapshot_below(order: list) -> dict:
    """id(node) -> whether any strict descendant holds a snapshot (children come after parents in `order`)."""
    below: dict[int, bool] = {}
    for node, _ in reversed(order):
        below[id(node)] = any(child.snapshot is not None or below[id(child)] for child in node.children.values())
    return below


def rank_snapshot_victim(tree, eligible):
    ranked = rank_snapshots(tree.root, eligible)
    return min(ranked, key=lambda pair: pair[0])[1] if ranked else None


# ---- the tree -----------------------------------------------------------------------------------

def build(conversations: int, turns: int) -> HybridPrefixCache:
    nodes = conversations * turns
    kv = KVPool(1, nodes + 128, PAGE, 1, 1, torch.float32)  # the tree's pages and one request's table
    entries = (StateTensor("conv", (2, 1), torch.float32), StateTensor("recurrent", (1, 1, 1), torch.float32))
    states = StatePool(StateSpec((LayerState(0, entries),)), 2)
    device = DeviceTier(states, (nodes + 8) * states.bytes_per_slot, 1, kv, 20e9)
    cache = HybridPrefixCache(kv, states, TierSet(device), PlacementOptions(page_size=PAGE))
    slot = states.alloc()
    system = list(range(1000, 1000 + 8 * PAGE))
    for c in range(conversations):
        path = list(system)
        for t in range(turns):
            path += [c % 997, t, c // 997, 7]  # one page per turn
            table = kv.allocator.alloc(len(path) // PAGE)
            handle = cache.tiers.store_snapshot(states, slot, None)
            entry = SnapshotEntry(handle.copies[DEVICE].nbytes, "grid", False, handle)
            if not cache.tree.attach_snapshot(path, table, entry):
                cache.tiers.release(handle)
            kv.allocator.decref(table)
    return cache


def on_device(entry) -> bool:
    return DEVICE in entry.handle.copies


def kv_before(cache, victims: int) -> tuple[float, list[int]]:
    started, order = time.perf_counter(), []
    for _ in range(victims):
        node = scan_kv_victim(cache.tree, DEVICE)
        order.append(node.node_id)
        cache.tree.drop_kv(node, DEVICE)
    return time.perf_counter() - started, order


def kv_after(cache, pages: int) -> tuple[float, list[int]]:
    before = {n.node_id for n in cache.tree.iter_nodes()}
    started = time.perf_counter()
    cache.tiers.free_device_pages(pages)
    elapsed = time.perf_counter() - started
    return elapsed, sorted(before - {n.node_id for n in cache.tree.iter_nodes()})


def snap_before(cache, victims: int) -> tuple[float, list[int]]:
    started, order = time.perf_counter(), []
    for _ in range(victims):
        node = rank_snapshot_victim(cache.tree, on_device)
        order.append(node.end * 1_000_003 + node.node_id)
        cache.tiers.demote_snapshot(node, cache.tiers.device)
    return time.perf_counter() - started, order


def snap_after(cache, victims: int) -> tuple[float, list[int]]:
    started, order = time.perf_counter(), []
    queue = SnapshotVictims(cache.tree, on_device)
    for _ in range(victims):
        node = queue.pop()
        order.append(node.end * 1_000_003 + node.node_id)
        cache.tiers.demote_snapshot(node, cache.tiers.device)
    return time.perf_counter() - started, order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--kv-victims", type=int, default=50)
    ap.add_argument("--snapshot-victims", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: dict[str, list[float]] = {k: [] for k in ("kv_before", "kv_after", "snap_before", "snap_after",
                                                    "one_before", "one_after")}
    for _ in range(args.repeats):
        a, b = build(args.conversations, args.turns), build(args.conversations, args.turns)
        t_old, kv_old = kv_before(a, args.kv_victims)
        t_new, kv_new = kv_after(b, args.kv_victims)  # one page per leaf: as many pages as victims
        assert sorted(kv_old) == kv_new, "the two KV victim orders differ"
        rows["kv_before"].append(t_old)
        rows["kv_after"].append(t_new)
        t_old, s_old = snap_before(a, args.snapshot_victims)
        t_new, s_new = snap_after(b, args.snapshot_victims)
        assert s_old == s_new, "the two snapshot victim orders differ"
        rows["snap_before"].append(t_old)
        rows["snap_after"].append(t_new)
        rows["one_before"].append(snap_before(a, 1)[0])
        rows["one_after"].append(snap_after(b, 1)[0])
        nodes = a.tree.num_nodes
    best = {k: min(v) for k, v in rows.items()}
    print(f"CPU: {platform.processor() or platform.machine()}, {nodes} nodes, torch threads 1, "
          f"best of {args.repeats}\n")
    print("| eviction | before (scan per victim) | after (heap per call) | speed-up |")
    print("|---|---|---|---|")
    for label, key, n in (("KV victims", "kv", args.kv_victims), ("snapshot victims", "snap", args.snapshot_victims),
                          ("snapshot victim", "one", 1)):
        before, after = best[f"{key}_before"], best[f"{key}_after"]
        print(f"| {n} {label}, one call | {before * 1e3:.1f} ms | {after * 1e3:.1f} ms | "
              f"{before / after:.1f}x |")


if __name__ == "__main__":
    main()
