"""Offload: large inputs are parsed and tokenized in a worker process, with the same results as in a
thread, and that process never loads torch."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from cairn.errors import PromptTooLong
from cairn.prompt import tokenize_prompt
from cairn.server.offload import Offload
from cairn.tokenizer import ByteTokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo " * 20}]


def torch_loaded() -> bool:
    return "torch" in sys.modules


@pytest.fixture
def offload(monkeypatch):
    monkeypatch.setattr("cairn.server.offload.LARGE_INPUT_BYTES", 16)  # everything but tiny inputs is "large"
    off = Offload(ByteTokenizer(), max_model_len=1000)
    yield off
    off.close()


def test_large_prompt_is_tokenized_in_a_worker_process_exactly_as_in_a_thread(offload):
    got = asyncio.run(offload.tokenize(None, MESSAGES, None))
    assert got == tokenize_prompt(ByteTokenizer(), None, MESSAGES)
    assert asyncio.run(offload.tokenize("a text prompt", None, None)).token_ids == list(b"a text prompt")
    assert offload._processes.submit(torch_loaded).result() is False


def test_too_long_prompt_is_refused_across_the_process_boundary(offload):
    with pytest.raises(PromptTooLong, match="context is 1000 tokens"):
        asyncio.run(offload.tokenize("x" * 100_000, None, None))


def test_large_json_body_is_parsed_in_a_worker_process(offload):
    body = json.dumps({"messages": MESSAGES}).encode()
    assert asyncio.run(offload.parse_json(body)) == {"messages": MESSAGES}
    with pytest.raises(ValueError):
        asyncio.run(offload.parse_json(b'{"messages": [' + b" " * 100))
