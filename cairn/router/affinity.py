"""Placements: which replica the router last sent each conversation prefix to, so it probes only when that
could change the choice.

A chat request's prefix keys are digests chained over what its rendering depends on besides the messages
(model, tools, chat_template_kwargs; an Anthropic Messages body's system and thinking too) and then its
messages one by one:

    messages      m0       m1       m2       m3
    keys          k0       k1       k2       k3        k_i = H(k_{i-1} | H(m_i)),  k_-1 = H(model, tools, ...)

When a request is sent to replica R, each of its keys is recorded as placed on R (the latest placement of a
key wins). For a new request, the deepest of its keys that is recorded names the replica that served the
longest message prefix of it, so the one that can resume it deepest: a replica places a snapshot at every
message boundary, and no other replica served that prefix since (it would hold the key now). Without a
known key (a new conversation, or a router restarted) the router probes.

What this does not know: requests that reached the replicas without this router, and what a replica evicted
or lost in a restart (then every replica is as cold, or reads the same Redis: sending the request to R loses
nothing). What it is not: the choice itself (app.py) or the ranking of probes (replicas.py). Torch-free.

A request that names its conversation (`prompt_cache_key`, on chat, completions and Responses bodies: the Codex
CLI sends its session id) gets one more key, the deepest, from the key and the model: requests with the same
key go where the last one went, whatever their messages (a compacted or edited history keeps its replica).

The router also keeps a Placements of Responses API ids (each the one key of a stored response), to send a
follow-up (previous_response_id) to the replica that stores the response it names.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

# what a prompt's rendering reads besides the messages: a chat's fields, then an Anthropic Messages body's own
RENDER_FIELDS = ("model", "tools", "chat_template_kwargs", "system", "thinking")
DIGEST_BYTES = 16


def prefix_keys(body: dict) -> list[bytes]:
    """The chained key of each message prefix of a chat request body ([] when it has no message list)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    key = _digest(_canonical({f: body.get(f) for f in RENDER_FIELDS}))
    keys = []
    for message in messages:
        key = _digest(key + _digest(_canonical(message)))
        keys.append(key)
    return keys


# the routes whose body is a message list (prefix_keys); each of the three generation routes reads prompt_cache_key
PREFIX_ROUTES = ("/v1/chat/completions", "/v1/messages")


def routing_keys(path: str, body: dict) -> list[bytes]:
    """A request's keys for Placements: a chat or Messages body's prefix keys, then its prompt_cache_key's."""
    keys = prefix_keys(body) if path in PREFIX_ROUTES else []
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        keys.append(_digest(b"prompt_cache_key\0" + _canonical([body.get("model"), cache_key])))
    return keys


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


class Placements:
    """Prefix key -> the URL of the replica it was last sent to; at most `max_keys`, least recently placed
    forgotten first (0: remember nothing, so every request is probed)."""

    def __init__(self, max_keys: int):
        self.max_keys = max_keys
        self._where: OrderedDict[bytes, str] = OrderedDict()

    def record(self, keys: list[bytes], url: str) -> None:
        """Every key of a request just sent to the replica at `url`."""
        if not self.max_keys:
            return
        for key in keys:
            self._where[key] = url
            self._where.move_to_end(key)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def deepest(self, keys: list[bytes]) -> tuple[int, str] | None:
        """(number of messages, replica URL) of the deepest recorded prefix among `keys`; None when none is."""
        for depth in range(len(keys), 0, -1):
            url = self._where.get(keys[depth - 1])
            if url is not None:
                return depth, url
        return None

    def drop(self, key: bytes) -> None:
        self._where.pop(key, None)

    def forget(self, url: str) -> None:
        """Drop every placement on a replica (it failed: whatever it held may be gone)."""
        for key in [k for k, u in self._where.items() if u == url]:
            del self._where[key]

    def __len__(self) -> int:
        return len(self._where)
