"""The cost of one turn at long history: what a turn costs outside the model step, per stage, against history length.

For each history length (8k, 64k, 256k, 1M tokens by default), builds on CPU the state a server holds after a
long conversation, without running a model: a real `HybridPrefixCache` from `build_cache` (a device tier and a
disk tier in a temporary directory) over KV and state pools of one tiny layer, and drives it as the scheduler
does. The history is one conversation of `--turn-tokens`-token messages, prefilled as one request in chunks of
`--chunk` tokens (admit, captures, after_step per chunk, release): the snapshots sit where the placement policy
puts them (the grid, every message start, the prompt end, the request end) and the disk tier's write-through
holds the segments and the tree's index of them. Then one more turn, `--new-tokens` appended as a new message,
is timed stage by stage:

    render       the chat template over the whole conversation (ByteTokenizer, the demo model's template)
    tokenize     encoding that text, with the message starts
    match        HybridPrefixCache's tree match (and the disk index's forget / relink before it)
    plan         the resume planner over the matched path
    resume       lock, page table, loading the snapshot into the working slot, promotion
    place        the snapshot placement of the new prompt (with the walk for a deeper snapshot)
    captures     captures + after_step over the new tokens (snapshot bookkeeping, attaching to the tree)
    release      the request end's snapshot, insert, the disk tier's write-through (hash chains, segment writes)

Render and tokenize are the API's: the client sends the whole conversation every turn, so they are inherent and
reported apart from the cache's work (match .. release). Memory: Python heap growth (tracemalloc) of building
the history, i.e. the tree and the tier indexes (the tiny pools' tensors are not in it), per history token.

    PYTHONPATH=. nice -n 10 python benchmarks/turn_cost_bench.py --out benchmarks/out/turn_cost_bench.json
    PYTHONPATH=. python benchmarks/turn_cost_bench.py --histories 8192,65536 --repeats 3

A benchmark, not a test: asserts nothing. Each turn is timed `--repeats` times on a fresh copy of the
history's last request (the tree keeps the turns added by earlier repeats: each repeat appends to the one before).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from benchmarks.decode_bench import cpu_info
from cairn.cache import hybrid
from cairn.cache.base import CacheRequest
from cairn.cache.factory import build_cache
from cairn.config import CacheOptions
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import LayerState, StateSpec, StateTensor
from cairn.request.tokenizer import ByteTokenizer

PAGE = 16
CACHE_STAGES = ("match", "plan", "resume", "place", "captures", "release")
PLACE = hybrid.place  # the placement itself: each history's cache wraps this, never the wrapper before it


class Timer:
    """Accumulated seconds per stage name, with wrappers that time a callable under a name."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False

    @contextmanager
    def stage(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.active:
                self.seconds[name] += time.perf_counter() - started

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self.stage(name):
                return fn(*args, **kwargs)
        return timed


def build(history_tokens: int, new_tokens: int, disk_dir: str, timer: Timer):
    """The cache, its pools and the tokenizer, with the admission's sub-stages wrapped in `timer`."""
    num_pages = (history_tokens + 8 * new_tokens + 4096) // PAGE * 2
    kv = KVPool(1, num_pages, PAGE, 1, 1, torch.float32)
    entries = (StateTensor("conv", (2, 1), torch.float32), StateTensor("recurrent", (1, 1, 1), torch.float32))
    states = StatePool(StateSpec((LayerState(0, entries),)), 4)
    slots = history_tokens // 512 + 4096  # room for every snapshot the history and the turns take
    opts = CacheOptions(device_snapshot_gib=slots * (states.bytes_per_slot + 8 * 4) / 2**30, host_cache_gib=0,
                        disk_cache=disk_dir, disk_cache_gib=64.0)
    cache = build_cache(opts, kv, states, vocab_size=8, digest="7c" * 32)
    cache._match = timer.wrap("match", cache._match)
    cache._forget_stale_disk_keys = timer.wrap("match", cache._forget_stale_disk_keys)
    cache._plan = timer.wrap("plan", cache._plan)
    cache._resume = timer.wrap("resume", cache._resume)
    cache._has_snapshot_beyond = timer.wrap("place", cache._has_snapshot_beyond)
    hybrid.place = timer.wrap("place", PLACE)
    return cache, kv, states


def conversation(history_tokens: int, turn_tokens: int) -> list[dict]:
    """Alternating user / assistant messages whose rendered text is about history_tokens bytes."""
    messages, total, i = [{"role": "system", "content": "You are a helpful assistant."}], 0, 0
    while total < history_tokens:
        role = "user" if i % 2 == 0 else "assistant"
        content = "".join(chr(97 + (i * 7 + j) % 26) for j in range(turn_tokens - 30))
        messages.append({"role": role, "content": content})
        total += turn_tokens
        i += 1
    return messages


def run_request(cache, kv, states, ids, starts, chunk: int, timer: Timer | None, reply: int = 0):
    """One request through the cache as the scheduler drives it; returns its Admission's report."""
    slot = states.alloc()
    req = CacheRequest(ids, slot, message_starts=starts, user_message_starts=starts[::2])
    if timer is not None:
        timer.active = True
    adm = cache.admit(req)
    table = list(adm.page_table)
    pos = adm.num_cached
    total = len(ids) + reply
    table += kv.allocator.alloc(-(-total // PAGE) - len(table))
    tokens = list(ids) + [1] * reply
    with timer.stage("captures") if timer else nullcontext():
        while pos < total:
            end = min(pos + chunk, total)
            if pos < len(ids):
                end = min(end, len(ids))
            cache.captures(adm, pos, end)
            pos = end
            cache.after_step(adm, CacheRequest(tokens, slot, table, pos), torch.zeros(8))
    with timer.stage("release") if timer else nullcontext():
        cache.release(adm, CacheRequest(tokens, slot, table, pos), finished=True)
    if timer is not None:
        timer.active = False
    kv.allocator.decref(table)
    states.free(slot)
    return adm.report, tokens


def measure(history_tokens: int, args) -> dict:
    timer = Timer()
    tok = ByteTokenizer()
    messages = conversation(history_tokens, args.turn_tokens)
    with tempfile.TemporaryDirectory() as disk_dir:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        cache, kv, states = build(history_tokens, args.new_tokens, disk_dir, timer)
        ids, starts = tok.encode_chat(messages)
        _, tokens = run_request(cache, kv, states, ids, starts, args.chunk, None, reply=args.reply)
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        history = len(tokens)
        turns = []
        for r in range(args.repeats):
            messages = [*messages, {"role": "assistant", "content": "x" * args.reply},
                        {"role": "user", "content": "".join(chr(97 + (r + j) % 26) for j in range(args.new_tokens))}]
            timer.seconds.clear()
            timer.active = True
            with timer.stage("render"):
                text, char_starts = tok.render_chat_with_starts(messages)
            with timer.stage("tokenize"):
                ids, starts = tok.encode_rendered(text, char_starts)
            timer.active = False
            report, _ = run_request(cache, kv, states, ids, starts, args.chunk, timer, reply=args.reply)
            turns.append({**{k: v * 1e3 for k, v in timer.seconds.items()}, "resumed": report.resume_position,
                          "prompt": len(ids)})
        best = {s: min(t.get(s, 0.0) for t in turns) for s in ("render", "tokenize", *CACHE_STAGES)}
        best["cache_total"] = min(sum(t.get(s, 0.0) for s in CACHE_STAGES) for t in turns)
        cache.check_integrity()
        row = {"history_tokens": history, "nodes": cache.tree.num_nodes, "snapshots": cache.tree.num_snapshots,
               "disk_segments": len(cache.indexes["disk"].tier.store) if hasattr(cache.indexes["disk"], "tier")
               else None, "python_heap_bytes": held, "heap_bytes_per_token": held / history,
               "resumed": turns[-1]["resumed"], "prompt": turns[-1]["prompt"], "ms": best, "turns": turns}
        cache.close()
        return row


def table(rows: list[dict]) -> str:
    cols = ("render", "tokenize", *CACHE_STAGES, "cache_total")
    lines = ["| history | nodes | snapshots | " + " | ".join(cols) + " | heap B/token |",
             "|---:|---:|---:|" + "---:|" * (len(cols) + 1)]
    for r in rows:
        lines.append(f"| {r['history_tokens']:,} | {r['nodes']:,} | {r['snapshots']:,} | "
                     + " | ".join(f"{r['ms'][c]:.2f}" for c in cols) + f" | {r['heap_bytes_per_token']:.1f} |")
    if len(rows) > 1:
        first, last = rows[0]["ms"], rows[-1]["ms"]
        lines.append("| ratio last/first | | | " + " | ".join(
            f"{last[c] / first[c]:.1f}x" if first[c] > 0 else "-" for c in cols) + " | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--histories", default="8192,65536,262144,1048576", help="history lengths, tokens")
    ap.add_argument("--new-tokens", type=int, default=200, help="tokens of the new user message")
    ap.add_argument("--reply", type=int, default=64, help="tokens generated per turn (decode steps, untimed)")
    ap.add_argument("--turn-tokens", type=int, default=2048, help="tokens per message of the history")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk, tokens (the scheduler's budget)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/out/turn_cost_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in (int(x) for x in args.histories.split(",")):
        rows.append(measure(n, args))
        print(f"history {rows[-1]['history_tokens']:,}: cache {rows[-1]['ms']['cache_total']:.2f} ms", flush=True)
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpu": cpu_info(), "torch": torch.__version__}, "args": vars(args),
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
