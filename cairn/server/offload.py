"""Offload: the heavy per-request work (parsing a JSON body, rendering and tokenizing a prompt) kept
off the event loop and the engine thread.

Python threads share one interpreter lock, and a C call such as `json.loads` on a 20 MiB body holds
it from start to end: the engine thread (and the event loop sending other streams' tokens) would
wait. So the work on a large input (over LARGE_INPUT_BYTES) runs in a small pool of worker
*processes* (spawned, holding their own copy of the tokenizer, without torch), and only its result
comes back; smaller inputs, where a process round trip would cost more than the work, run in a
thread pool.

    parse_json(body) -> object            (json.loads)
    tokenize(prompt, messages, kwargs)    -> TokenizedPrompt (prompt.tokenize_prompt)

What this is not: validation of the parsed body (the protocol models) or of the prompt against the
model's vocabulary (the engine).
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from cairn.prompt import TokenizedPrompt, tokenize_prompt
from cairn.tokenizer import Tokenizer

LARGE_INPUT_BYTES = 1 << 20  # inputs from this size on are handled in a worker process
NUM_THREADS = 2
NUM_PROCESSES = 1
_worker_tokenizer: Tokenizer | None = None  # in a worker process: its copy of the server's tokenizer


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _tokenize_in_worker(*args) -> TokenizedPrompt:
    return tokenize_prompt(_worker_tokenizer, *args)


def _warm_up() -> None:
    """Runs once in each worker process so that its start-up is paid at server start."""


class Offload:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._threads = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="cairn-tokenize")
        self._processes = ProcessPoolExecutor(NUM_PROCESSES, mp_context=multiprocessing.get_context("spawn"),
                                              initializer=_init_worker, initargs=(tokenizer,))

    def start(self) -> None:
        """Start the worker processes now rather than on the first large request."""
        for _ in range(NUM_PROCESSES):
            self._processes.submit(_warm_up)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._processes.shutdown(wait=False, cancel_futures=True)

    async def parse_json(self, body: bytes) -> Any:
        """json.loads(body); raises json.JSONDecodeError."""
        if len(body) < LARGE_INPUT_BYTES:
            return json.loads(body)
        return await self._run(self._processes, json.loads, body)

    async def tokenize(self, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
                       template_kwargs: dict[str, Any] | None,
                       message_starts: list[int] | None = None) -> TokenizedPrompt:
        """tokenize_prompt (see `prompt`), refusing what cannot fit in max_model_len before encoding it."""
        args = (prompt, messages, template_kwargs, self.max_model_len, message_starts)
        if _input_chars(prompt, messages) < LARGE_INPUT_BYTES:
            return await self._run(self._threads, tokenize_prompt, self.tokenizer, *args)
        return await self._run(self._processes, _tokenize_in_worker, *args)

    @staticmethod
    async def _run(pool: Executor, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


def _input_chars(prompt: str | list[int] | None, messages: list[dict[str, Any]] | None) -> int:
    """About how much text the prompt holds (token ids count as nothing: they need no tokenizer)."""
    if messages is None:
        return len(prompt) if isinstance(prompt, str) else 0
    return sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
