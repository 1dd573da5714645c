"""What pauses a running stream, on a real `cairn serve`: the interpreter's garbage collector; and
each engine step's token reaches the client as its own event (never held for a later step's).

A full (generation 2) collection walks every object the collector tracks while holding the
interpreter lock; after start-up the demo server tracks about 325,000 (the model, the tokenizer, the
imported libraries), and one such collection took 175-220 ms in the middle of an engine step: one
token of every stream 20x late. The server freezes what is alive after start-up (`settle_heap`) so
that later collections never walk it. Timing is left to benchmarks/stall_timeline.py; these tests check
that the server froze its start-up heap (and says how much in /metrics), that the freeze frees garbage
first, and that every step reaches the client as its own event.
"""

from __future__ import annotations

import gc
import json
import weakref

import httpx
import pytest

from cairn.server.main import settle_heap
from tests.server_process import start_server

MIN_FROZEN_OBJECTS = 50_000  # the demo server's start-up heap, with room to spare (about 325,000 today)


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.stop()


def metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
              or line.startswith(name + "{")]
    assert values, f"{name} is not in /metrics"
    return sum(values)


def test_startup_objects_are_frozen_out_of_full_collections(server):
    body = {"model": "cairn-demo-random", "prompt": "once upon a time", "max_tokens": 8, "temperature": 0}
    assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert metric(text, "cairn_gc_frozen_objects") >= MIN_FROZEN_OBJECTS
    assert metric(text, "cairn_gc_collections_total") >= 0  # exported, per generation


def test_settle_heap_collects_garbage_then_freezes_what_is_alive():
    class Node:
        def __init__(self):
            self.me = self  # a reference cycle: only the collector frees it

    garbage, kept = weakref.ref(Node()), Node()
    try:
        assert settle_heap() > 0
        assert garbage() is None  # collected, not frozen for the life of the process
        assert all(obj is not kept for obj in gc.get_objects())  # out of every generation: never walked again
    finally:
        gc.unfreeze()


def test_each_step_of_a_stream_is_written_as_its_own_event(server):
    """The event loop writes every step's output as it arrives (one token per event at n=1), so a
    client sees tokens at the engine's pace, not in bursts (the stall benchmarks' gaps rely on it)."""
    body = {"model": "cairn-demo-random", "prompt": "a story", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    per_event = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line.removeprefix("data: "))["choices"]
                per_event += [len(c.get("token_ids") or []) for c in choices]
    assert sum(per_event) == 24
    assert set(per_event) == {1}
