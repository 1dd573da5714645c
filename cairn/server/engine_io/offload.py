"""Offload: the heavy per-request work (parsing a JSON body, validating it, rendering and tokenizing
a prompt) kept off the event loop and the engine thread.

Python threads share one interpreter lock, and a C call such as `json.loads` on a 20 MiB body, or a
copy of it, holds it from start to end: the engine thread (and the event loop sending other streams'
tokens) would wait. So a large request body (LARGE_INPUT_BYTES or more) goes, as the chunks it
arrived in, to a worker process (see `workers`) that prepares the whole request and sends back only
the result (token ids, not text); smaller inputs, where a process round trip would cost more than
the work, are handled in the server process (tokenizing in a thread pool).

    run(fn, chunks, *args)                 fn(context, body, *args) in a worker process (see `prepare`)
    parse_json(chunks) -> object           json.loads
    tokenize(prompt, messages, kwargs)     -> TokenizedPrompt (prompt.tokenize_prompt)

What this is not: the validation of a body (the protocol models, see `prepare`) or of a prompt
against the model's vocabulary (the engine).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cairn.request.prompt import TokenizedPrompt, tokenize_prompt
from cairn.request.tokenizer import Tokenizer
from cairn.server.engine_io.workers import ProcessWorkers, in_thread

LARGE_INPUT_BYTES = 256 << 10  # bodies and prompts from this size on are handled in a worker process
NUM_THREADS = 2
NUM_PROCESSES = 1


@dataclass(frozen=True)
class WorkerContext:
    """What every worker job gets (the server passes its own, with more fields): picklable."""

    tokenizer: Tokenizer
    max_model_len: int


def _parse_json(_: Any, body: bytes) -> Any:
    return json.loads(body)


def _tokenize(context: Any, _: bytes, *args) -> TokenizedPrompt:
    return tokenize_prompt(context.tokenizer, *args)


class Offload:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, worker_context: Any = None,
                 large_input_bytes: int | None = None):
        """`worker_context` (default: a WorkerContext) must have `tokenizer` and `max_model_len`."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.large_input_bytes = LARGE_INPUT_BYTES if large_input_bytes is None else large_input_bytes
        self._threads = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="cairn-tokenize")
        self.workers = ProcessWorkers(NUM_PROCESSES, worker_context or WorkerContext(tokenizer, max_model_len))

    def start(self) -> None:
        """Start the worker processes now rather than on the first large request."""
        self.workers.start()

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.workers.close()

    def is_large(self, chunks: Sequence[bytes]) -> bool:
        return sum(len(c) for c in chunks) >= self.large_input_bytes

    async def run(self, fn, chunks: list[bytes], *args) -> Any:
        """fn(worker context, b"".join(chunks), *args) in a worker process; empties `chunks` (see `workers`)."""
        return await self.workers.run(fn, chunks, *args)

    async def parse_json(self, chunks: list[bytes]) -> Any:
        """json.loads of the body; raises what json.loads raises (see prepare.JSON_ERRORS)."""
        if not self.is_large(chunks):
            return json.loads(b"".join(chunks))
        return await self.workers.run(_parse_json, chunks)

    async def tokenize(self, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
                       template_kwargs: dict[str, Any] | None,
                       message_starts: list[int] | None = None) -> TokenizedPrompt:
        """tokenize_prompt (see `prompt`), refusing what cannot fit in max_model_len before encoding it;
        WorkersClosed once closed."""
        args = (prompt, messages, template_kwargs, self.max_model_len, message_starts)
        if _input_chars(prompt, messages) >= self.large_input_bytes:
            return await self.workers.run(_tokenize, (), *args)
        return await in_thread(self._threads, functools.partial(tokenize_prompt, self.tokenizer, *args))


def _input_chars(prompt: str | list[int] | None, messages: list[dict[str, Any]] | None) -> int:
    """About how much text the prompt holds (token ids count as nothing: they need no tokenizer)."""
    if messages is None:
        return len(prompt) if isinstance(prompt, str) else 0
    return sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
