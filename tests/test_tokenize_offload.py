"""/tokenize and /detokenize with a large body: handled whole in a request worker process (parsed, tokenized or
decoded, and its JSON written there), never in the server process, whose interpreter lock the engine thread
shares; the answer and the errors are those of a small body handled in the server process."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse

from cairn.request.tokenizer import ByteTokenizer
from cairn.server.engine_io.offload import Offload
from cairn.server.errors import APIError
from cairn.server.serving import ServingContext
from cairn.server.tokenize import respond


class RefusedInServer(ByteTokenizer):
    """A ByteTokenizer that raises when it encodes or decodes in the process that made it (the server)."""

    def __init__(self, server_pid: int):
        super().__init__()
        self.server_pid = server_pid

    def __reduce__(self):
        return RefusedInServer, (self.server_pid,)

    def _check(self) -> None:
        if os.getpid() == self.server_pid:
            raise AssertionError("tokenizer work in the server process")

    def encode_with_offsets(self, text: str):
        self._check()
        return super().encode_with_offsets(text)

    def decode(self, ids: list[int]) -> str:
        self._check()
        return super().decode(ids)


PLAIN = ServingContext(None, None, ByteTokenizer(), "cairn-demo-random", frozenset(), 1000, vocab_size=300)
REFUSED = ServingContext(None, None, RefusedInServer(os.getpid()), "cairn-demo-random", frozenset(), 1000,
                         vocab_size=300)
BODIES = [
    ("tokenize", {"prompt": "héllo <|im_end|> there " * 50}),
    ("tokenize", {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]}),
    ("tokenize", {"messages": [{"role": "user", "content": "héllo"}], "add_generation_prompt": False}),
    ("detokenize", {"tokens": [104, 195, 169, 108, 108, 111, 258] * 20}),
]
ERRORS = [
    ("tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}),  # both
    ("tokenize", {"prompt": "hi", "model": "other"}),
    ("detokenize", {"tokens": [1, 300]}),
    ("detokenize", {"tokens": "nope"}),
]


@pytest.fixture(scope="module")
def large():
    off = Offload(REFUSED.tokenizer, 1000, worker_context=REFUSED, large_input_bytes=0)  # every body is large
    yield off
    off.close()


@pytest.fixture(scope="module")
def small():
    off = Offload(PLAIN.tokenizer, 1000, worker_context=PLAIN)
    yield off
    off.close()


def _respond(ctx: ServingContext, offload: Offload, kind: str, body: dict):
    data = json.dumps(body).encode()
    return asyncio.run(respond(ctx, offload, [data[i:i + 64] for i in range(0, len(data), 64)], kind))


@pytest.mark.parametrize(("kind", "body"), BODIES)
def test_large_tokenize_body_is_answered_by_a_worker_process_as_a_small_one_here(large, small, kind, body):
    in_worker = _respond(REFUSED, large, kind, body)  # RefusedInServer raises if any of it ran here
    here = _respond(PLAIN, small, kind, body)
    assert isinstance(here, JSONResponse) and in_worker.media_type == "application/json"
    assert in_worker.body == here.body
    assert json.loads(in_worker.body)["tokens" if kind == "tokenize" else "prompt"]


@pytest.mark.parametrize(("kind", "body"), ERRORS)
def test_large_tokenize_body_gets_the_same_error_as_a_small_one(large, small, kind, body):
    errors = []
    for ctx, offload in ((REFUSED, large), (PLAIN, small)):
        with pytest.raises((RequestValidationError, APIError)) as info:
            _respond(ctx, offload, kind, body)
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1])
    if isinstance(errors[0], APIError):
        assert (errors[0].status, errors[0].message) == (errors[1].status, errors[1].message)
    else:
        assert repr(errors[0].errors()) == repr(errors[1].errors())  # (the ValueError in ctx: equal by repr)
