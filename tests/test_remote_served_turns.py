"""Round robin over two real `cairn serve` replicas on one real redis-server, as the replica bench drives them.

Each next turn goes to the other replica the moment the previous turn's last token is out (no waiting for
the write-behind, as a client does), and the replicas resume only at blocks of 64 tokens
(`--prefill-block 64`, as bfloat16 does at 512), so a conversation that leaves a stored one inside a
block has no snapshot where it leaves. Each turn must resume from Redis where one replica would have
resumed it (its prompt's last block boundary that the previous turn stored), and decode as cold.
The fixes this protects: a lookup waits for a deeper chain another replica is still writing
(cairn/cache/remote/markers.py); a node split off the front of a stored segment is written again as its
own segment, so the new conversation's chain can start below it (cairn/cache/segments/tier.py, `_to_write`).
"""

from __future__ import annotations

import httpx
import pytest

from tests.redis_server import replicas_on_redis
from tests.test_remote_served import chat, conversation

BLOCK = 64


@pytest.fixture(scope="module")
def replicas():
    with replicas_on_redis("--prefill-block", str(BLOCK)) as servers:
        yield servers


def next_turn(turn: list[dict], reply: dict, text: str) -> list[dict]:
    return turn + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""},
                   {"role": "user", "content": text}]


def resumed_as_one_replica_would(server_url: str, turn: list[dict], previous: dict) -> dict:
    """Serve `turn` at once on server_url; it resumes from Redis at the previous prompt's last block boundary
    and decodes as cold. Returns the reply."""
    warm = chat(server_url, turn)
    usage = warm["usage"]
    assert usage["cairn"]["tier"] == "remote", usage
    assert usage["prompt_tokens_details"]["cached_tokens"] == previous["usage"]["prompt_tokens"] // BLOCK * BLOCK
    cold = chat(server_url, turn, cache_prompt=False)
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    return warm


def test_each_next_turn_on_the_other_replica_resumes_from_redis_as_one_replica_would(replicas):
    a, b = replicas
    first = conversation()
    reply = chat(a.base_url, first)
    second = next_turn(first, reply, "Fix it.")
    resumed_as_one_replica_would(b.base_url, second, reply)  # while A may still be writing
    # the same task asked again, worded otherwise: it leaves the stored conversation inside a block of B's
    # (whose KV B only has in Redis), and its next turn goes to A at once
    other = [first[0], {"role": "user", "content": "Some handlers answer 201 where 200 is expected; fix them."},
             *first[2:]]
    reply3 = chat(b.base_url, other)
    assert reply3["usage"]["prompt_tokens_details"]["cached_tokens"] < reply3["usage"]["prompt_tokens"] // 2
    resumed_as_one_replica_would(a.base_url, next_turn(other, reply3, "Run the tests again."), reply3)
    assert "unknown_parent" not in httpx.get(b.base_url + "/metrics", timeout=30).text  # no segment refused
