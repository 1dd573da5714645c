"""BodySizeLimit's pacing of large request bodies (--body-read-mib-per-s): past its first
PACE_AFTER_BYTES a body is read no faster than the limit, so that receiving megabytes back to back
does not keep the event loop (and the interpreter lock the engine thread needs) busy; smaller bodies
are never held, and the app gets every chunk, in order. The sleeps are recorded, not slept, so these
tests assert what the middleware asks for, not how long anything took.
"""

from __future__ import annotations

import asyncio

import pytest

from cairn.server.http import middleware
from cairn.server.http.middleware import PACE_AFTER_BYTES, BodySizeLimit

MIB = 1 << 20
CHUNK = 64 << 10


def read_through(body_bytes: int, max_bytes_per_s: float, monkeypatch) -> tuple[list[float], list[bytes]]:
    """Send a body of `body_bytes` (in CHUNK pieces, as fast as possible) through BodySizeLimit;
    returns the sleeps it asked for and the chunks the app received."""
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def record(delay: float, *args) -> None:
        sleeps.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(middleware.asyncio, "sleep", record)
    pieces = [bytes([i % 251]) * CHUNK for i in range(body_bytes // CHUNK)]
    received: list[bytes] = []

    async def receive() -> dict:
        chunk = pieces.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pieces)}

    async def app(scope, app_receive, send) -> None:
        while True:
            message = await app_receive()
            received.append(message["body"])
            if not message["more_body"]:
                return

    async def send(message) -> None:
        raise AssertionError(f"no error expected, got {message}")

    limit = BodySizeLimit(app, max_bytes=64 * MIB, max_bytes_per_s=max_bytes_per_s)
    asyncio.run(limit({"type": "http", "headers": []}, receive, send))
    return sleeps, received


def test_large_body_is_read_no_faster_than_the_limit(monkeypatch):
    sleeps, received = read_through(PACE_AFTER_BYTES + MIB, max_bytes_per_s=1 * MIB, monkeypatch=monkeypatch)
    assert b"".join(received) == b"".join(bytes([i % 251]) * CHUNK for i in range(len(received)))
    assert sum(map(len, received)) == PACE_AFTER_BYTES + MIB
    # (the sleeps were not slept: the last one asks for the whole MiB past PACE_AFTER_BYTES at 1 MiB/s)
    assert 0.5 < max(sleeps) <= 1.0


@pytest.mark.parametrize("body_bytes, rate", [(PACE_AFTER_BYTES, 1 * MIB), (8 * MIB, 0.0)])
def test_small_body_or_no_limit_is_never_held(monkeypatch, body_bytes, rate):
    sleeps, received = read_through(body_bytes, max_bytes_per_s=rate, monkeypatch=monkeypatch)
    assert sleeps == []
    assert sum(map(len, received)) == body_bytes
