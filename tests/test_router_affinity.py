"""The router's memory of where each conversation prefix went (cairn/router/affinity.py), and the choice it
makes from it without probing (cairn/router/app.py's Router.ranked). Pure, except the last test, whose
probes reach a real closed port."""

from __future__ import annotations

import asyncio

from cairn.router.affinity import Placements, prefix_keys, routing_keys
from cairn.router.app import Router
from cairn.router.options import RouterOptions
from tests.server_process import free_port

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*contents: str, **fields) -> dict:
    return {"model": "m", "messages": [SYSTEM, *({"role": "user", "content": c} for c in contents)], **fields}


def test_prefix_keys_are_shared_exactly_as_far_as_the_messages_are():
    one, two, other = prefix_keys(chat("a", "b")), prefix_keys(chat("a", "b", "c")), prefix_keys(chat("a", "x"))
    assert len(one) == 2 + 1 and two[:3] == one
    assert other[:2] == one[:2] and other[2] != one[2]
    assert prefix_keys(chat("a", "b", max_tokens=5, stream=True)) == one  # sampling does not change the prompt


def test_tools_and_template_arguments_change_every_key():
    plain = prefix_keys(chat("a"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for changed in (chat("a", tools=tools), chat("a", chat_template_kwargs={"enable_thinking": False}),
                    {**chat("a"), "model": "n"}):
        assert not set(prefix_keys(changed)) & set(plain)


def test_a_body_without_messages_has_no_keys():
    assert prefix_keys({"model": "m", "prompt": "hi"}) == [] and prefix_keys({"messages": "hi"}) == []


def test_the_deepest_known_prefix_names_the_replica_that_served_it_last():
    placements = Placements(max_keys=100)
    a, ab, abc = (prefix_keys(chat(*"abc"[:n])) for n in (1, 2, 3))
    assert placements.deepest(abc) is None
    placements.record(ab, "http://r0")
    placements.record(a, "http://r1")  # the shorter prefix moved: the deeper one stays where it was
    assert placements.deepest(abc) == (3, "http://r0") and placements.deepest(a) == (2, "http://r1")
    placements.forget("http://r0")
    assert placements.deepest(abc) == (2, "http://r1")


def test_placements_are_bounded_and_zero_remembers_nothing():
    placements = Placements(max_keys=4)
    old, new = prefix_keys(chat("old", "x", "y")), prefix_keys(chat("new", "x", "y"))
    placements.record(old, "http://r0")
    placements.record(new, "http://r1")
    assert len(placements) == 4 and placements.deepest(new) == (4, "http://r1")
    assert placements.deepest(old) == (1, "http://r1")  # old's own prefixes were forgotten; the system prompt moved
    off = Placements(max_keys=0)
    off.record(new, "http://r1")
    assert len(off) == 0 and off.deepest(new) is None


def ranked(router: Router, keys: list[bytes]) -> list[str]:
    return [r.url for r in asyncio.run(router.ranked("/v1/chat/completions", b"{}", {}, keys))]


def test_a_known_conversation_goes_to_its_replica_unless_that_one_is_busier_by_more_than_one():
    closed = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]  # nothing listens: a probe fails at once
    router = Router(closed, RouterOptions())
    keys = prefix_keys(chat("a", "b"))
    router.placements.record(keys[:2], closed[1])
    router.replicas[1].num_in_flight = 1
    router.replicas[2].num_in_flight = 1
    assert ranked(router, keys) == [closed[1], closed[0], closed[2]]  # placed first, then the least busy
    assert router.routed_by == {"placement": 1}
    router.replicas[1].num_in_flight = 2  # two more than r0: the probes must weigh cache against queue
    ranked(router, keys)
    assert router.routed_by["probe"] == 1
    assert all(not r.available() for r in router.replicas)  # the probes found nothing listening
    asyncio.run(router.close())


def test_a_prompt_cache_key_is_the_deepest_key_on_every_generation_route():
    """Requests naming one conversation share their last key whatever their messages (a compacted history), on
    chat, completions and Responses bodies; another model or key does not share it, and no key adds none."""
    first = routing_keys("/v1/chat/completions", chat("a", prompt_cache_key="session-1"))
    compacted = routing_keys("/v1/chat/completions", chat("summary", prompt_cache_key="session-1"))
    assert first[:-1] == prefix_keys(chat("a")) and first[-1] == compacted[-1]
    completion = routing_keys("/v1/completions", {"model": "m", "prompt": "hi", "prompt_cache_key": "session-1"})
    responses = routing_keys("/v1/responses", {"model": "m", "input": "hi", "prompt_cache_key": "session-1"})
    assert completion == responses == [first[-1]]
    other_model = routing_keys("/v1/responses", {"model": "n", "input": "hi", "prompt_cache_key": "session-1"})
    other_key = routing_keys("/v1/responses", {"model": "m", "input": "hi", "prompt_cache_key": "session-2"})
    assert other_model[-1] != first[-1] and other_key[-1] != first[-1]
    assert routing_keys("/v1/completions", {"model": "m", "prompt": "hi"}) == []
    assert routing_keys("/v1/chat/completions", chat("a")) == prefix_keys(chat("a"))


def test_a_request_with_a_known_prompt_cache_key_goes_where_its_conversation_went():
    closed = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    router = Router(closed, RouterOptions())
    router.placements.record(routing_keys("/v1/chat/completions", chat("a", "b", prompt_cache_key="s")), closed[2])
    compacted = routing_keys("/v1/chat/completions", chat("a summary of a and b", prompt_cache_key="s"))
    assert ranked(router, compacted)[0] == closed[2] and router.routed_by == {"placement": 1}
    asyncio.run(router.close())
