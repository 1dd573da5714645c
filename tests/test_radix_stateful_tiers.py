"""Stateful test of the tiered eviction: random operations on a prefix cache with a small host tier below the device.

What this is: a hypothesis `RuleBasedStateMachine` over the production TierSet with a device tier and a host
tier of a few KV pages and snapshot slots (tests/tiny_tiers.py), so that KV and snapshot victims move to the
host, the host fills and makes room, and requests go on from paths whose KV is on the host only. It checks
safety, not an order: after every step the cache's `check_integrity()` (tree, tiers, their bytes) holds, the
allocator's references equal the tree's plus the pages simulated requests hold, and every path a lock holds is
still matched whole. tests/test_radix_stateful.py checks the exact victim order against a reference model of a
device tier alone; a model of the moves between tiers would repeat the implementation, so this one asserts what
must hold whatever the order. It found that making room on a full host could drop the path of the very KV
being moved there (tests/test_radix.py has the regression test).
What it is not: a test of the engine, of page ids, or of the snapshot retention order.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.tiny_tiers import TinyCache

PAGE_SIZE = 4
MAX_LEN = 24
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=MAX_LEN).map(tuple)


class TieredRadixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = TinyCache(PAGE_SIZE, num_pages=64, device_slots=4, host_slots=3, host_pages=6)
        self.tree, self.alloc = self.cache.tree, self.cache.alloc
        self.paths: list[tuple[int, ...]] = []  # prompts seen, to draw shared prefixes from
        self.locks: list[tuple[object, tuple[int, ...]]] = []  # (handle, the prefix it holds)
        self.held: list[list[int]] = []  # page tables of simulated requests still running

    def draw_prompt(self, data) -> tuple[int, ...]:
        """Random tokens, or (2 times in 3) a seen prompt, often cut, then random tokens: shared prefixes."""
        tokens = data.draw(TOKENS)
        if self.paths and data.draw(st.integers(0, 2)) > 0:
            base = data.draw(st.sampled_from(self.paths))
            tokens = base[: data.draw(st.integers(1, len(base)))] + tokens[: data.draw(st.integers(0, 8))]
        return tokens[:MAX_LEN]

    def fresh_table(self, tokens) -> list[int] | None:
        """A request's own pages for every token (the tree takes references only for the tokens it lacks)."""
        num_pages = -(-len(tokens) // PAGE_SIZE)
        return self.alloc.alloc(num_pages) if num_pages <= self.alloc.num_free else None

    @rule(data=st.data(), keep=st.booleans())
    def insert(self, data, keep):
        tokens = self.draw_prompt(data)
        table = self.fresh_table(tokens)
        if table is None:
            return
        self.tree.insert(tokens, table)
        self.paths.append(tokens)
        (self.held.append if keep else self.alloc.decref)(table)

    @rule(data=st.data(), has_logits=st.booleans())
    def attach(self, data, has_logits):
        tokens = self.draw_prompt(data)
        table = self.fresh_table(tokens)
        if table is None:
            return
        self.tree.insert(tokens, table)
        cut = data.draw(st.integers(1, len(tokens)))
        self.cache.attach(tokens[:cut], table, label=object(), has_logits=has_logits)
        self.paths.append(tokens)
        self.alloc.decref(table)

    @rule(data=st.data())
    def lock(self, data):
        prompt = self.draw_prompt(data)
        result = self.tree.match(prompt, data.draw(st.booleans()))
        self.locks.append((self.tree.lock(result), prompt[: result.match_len]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        handle, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(handle)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish_request(self, data):
        self.alloc.decref(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))

    @rule(num_pages=st.integers(0, 8))
    def evict_pages(self, num_pages):
        self.cache.cache.evict_pages(num_pages)  # the scheduler's call: moves to the host, which makes room

    @rule(has_logits=st.booleans())
    def make_room(self, has_logits):
        self.cache.make_room(has_logits)

    @invariant()
    def integrity(self):
        self.cache.check(held=[page for table in self.held for page in table])

    @invariant()
    def locked_paths_are_kept(self):
        for _, prefix in self.locks:
            assert self.tree.match(prefix).match_len == len(prefix)


TestTieredRadixTree = TieredRadixMachine.TestCase
TestTieredRadixTree.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
