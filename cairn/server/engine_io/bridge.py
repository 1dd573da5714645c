"""EngineBridge: the engine's own thread, and how asyncio code hands it work and gets outputs back.

The engine is single-threaded, so exactly one thread (started here) makes every engine call:

    asyncio handlers ──(prepare / Offload.tokenize: a worker thread or process)──> TokenizedPrompt
    asyncio handlers ──(commands: thread-safe queue.Queue)──> engine thread: run commands, step()
    asyncio handlers <──(loop.call_soon_threadsafe: per-request asyncio.Queue)── outputs of each step

Nothing but the model runs long on the engine thread: a request's chat template and tokenizer run
once, in a worker (see `offload`), and its grammar is compiled in a worker thread (`compile_grammar`),
before the engine thread sees the request.

The engine thread blocks on the command queue while the engine has nothing to do (no busy wait),
and between steps runs every queued command (add, abort, stats...). A request's outputs arrive on
its `RequestStream` in order; the stream ends after the output that finishes the request (its last
choice when n > 1), or raises EngineFailure (engine.step() raised while the request was running, or
the engine failed this request alone: an output carrying `error`) or ServerShuttingDown (aborted by
a drain or stop). An exception in step() fails the requests that step touched (StepFailed names them;
the engine has freed their memory) and the thread keeps serving. `unhealthy()` says why the engine
cannot make progress (thread dead, steps failing in a row, every slot held while nothing runs): /health's 503.

What this is not: it knows nothing of HTTP, JSON or metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from cairn.engine.engine import Engine, StepFailed
from cairn.engine.outputs import RequestOutput
from cairn.errors import PromptTooLong, RequestTooLarge
from cairn.request.grammar import BudgetedGrammar, Grammar
from cairn.request.prompt import TokenizedPrompt
from cairn.request.sampling_params import SamplingParams
from cairn.server.engine_io.offload import Offload
from cairn.server.engine_io.workers import WorkersClosed
from cairn.server.errors import EngineFailure, ServerShuttingDown

log = logging.getLogger(__name__)
HURRY_POLL_S = 0.25  # how often stop(), waiting for a step, checks whether it was hurried
T = TypeVar("T")
UNHEALTHY_AFTER_FAILED_STEPS = 3  # /health says 503 after this many engine steps failed in a row
Sink = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


@dataclass(frozen=True)
class Submission:
    """One request for the engine (exactly one of prompt / messages / tokenized)."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None  # text or token ids
    messages: list[dict[str, Any]] | None = None  # chat messages, rendered by the engine's chat template
    template_kwargs: dict[str, Any] | None = None  # with messages: tools, chat_template_kwargs, generation_prefix
    message_starts: list[int] | None = None  # with token ids: where chat messages start in them
    tokenized: TokenizedPrompt | None = None  # the prompt already rendered and tokenized (by a request worker)
    fit_max_tokens: bool = False  # params.max_tokens is a placeholder: use all the context the prompt leaves


class RequestStream:
    """The outputs of one request, in order: `async for out in stream`. Consumed by one task, on `loop`."""

    def __init__(self, bridge: EngineBridge, request_id: str, outputs: asyncio.Queue, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self._bridge = bridge
        self._outputs = outputs
        self.done = False  # the finished output (or an error) has been taken

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.request_finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished; safe to call any number of times."""
        if not self.done:
            self.done = True
            self._bridge.abort(self.request_id)

    def expire_at(self, deadline_s: float) -> None:
        """On `loop`: at time.monotonic() `deadline_s` (a drain's), end the stream with ServerShuttingDown after
        the outputs it already holds, and abort the request. The engine thread aborts what is left at the same
        deadline too, but only between steps: a step running past it (a long prefill) would otherwise hold
        the stream until uvicorn cancels its task, cutting it without its error event."""
        def expire() -> None:
            if not self.done:
                self._outputs.put_nowait(_aborted_at_shutdown())
                self._bridge.abort(self.request_id)

        self.loop.call_later(max(0.0, deadline_s - time.monotonic()), expire)


def _aborted_at_shutdown() -> ServerShuttingDown:
    """What a stream still running when the server stops (a drain's deadline, or the stop) ends with."""
    return ServerShuttingDown("The server is shutting down; the request was aborted.")


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():  # the awaiting task was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
        loop.call_soon_threadsafe(fn, *args)


class EngineBridge:
    """Owns the engine thread. Every method may be called from any thread unless it says otherwise."""

    def __init__(self, engine: Engine, offload: Offload | None = None):
        self.engine = engine
        self.offload = offload  # where prompts are tokenized (required by submit)
        self.num_step_failures = 0  # engine.step() exceptions survived
        self.num_failed_steps_in_row = 0  # since the last step that succeeded
        self.stalled: str | None = None  # engine.stalled() as of the last step or command
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cairn-engine", daemon=True)
        self._streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()  # every stream handed out and alive
        self._streams_lock = threading.Lock()  # guards _streams and _expiry_s (drain may run on any thread)
        self._expiry_s: float | None = None  # the earliest drain deadline, as time.monotonic()
        # The fields below are touched only by the engine thread.
        self._sinks: dict[str, Sink] = {}  # request id -> where its outputs go
        self._draining = False  # refuse new requests
        self._drain_deadline_s: float | None = None  # time.monotonic() at which what is left is aborted
        self._stopping = False
        self._hurried = threading.Event()  # stop() no longer waits for a step past its timeout

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def draining(self) -> bool:
        """Shutting down: new requests are refused."""
        return self._draining

    def unhealthy(self) -> str | None:
        """Why the engine cannot make progress (None when it can): its thread is dead, its last steps all
        failed, or every working slot is held while nothing runs. Clears as soon as it can again."""
        if not self.alive:
            return "The engine thread is not running."
        if self.num_failed_steps_in_row >= UNHEALTHY_AFTER_FAILED_STEPS:
            return f"The last {self.num_failed_steps_in_row} engine steps failed."
        if self.stalled is not None:
            return f"The engine cannot admit requests: {self.stalled}."
        return None

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests from now on (ServerShuttingDown); abort those still running timeout_s after this
        call (or at an earlier deadline an earlier call set). Their streams end at the deadline even while the
        engine thread is inside a step (`RequestStream.expire_at`)."""
        deadline = time.monotonic() + timeout_s
        with self._streams_lock:
            self._expiry_s = min(deadline, self._expiry_s or deadline)
            streams = list(self._streams)
        for stream in streams:
            _post(stream.loop, stream.expire_at, deadline)

        def begin() -> None:
            self._draining = True
            self._drain_deadline_s = min(deadline, self._drain_deadline_s or deadline)
        self._commands.put(begin)

    def stop(self, timeout_s: float) -> None:
        """Abort every request (their streams raise ServerShuttingDown) and end the thread. Blocks until the
        thread has ended: its step finished, what the aborted requests computed written to the cache and the
        cache closed. A step can outlast timeout_s (a long prefill on a CPU); past it, stop() logs that it
        waits, and waits on unless `hurry()` is or was called, then returns with the thread still running."""
        def end() -> None:
            self._draining = self._stopping = True
        self._commands.put(end)
        if self.offload is not None:
            self.offload.close()
        if self.alive:
            self._thread.join(timeout_s)
        if self.alive and not self._hurried.is_set():
            log.warning("the engine thread is still inside a step %.0f s after the stop; waiting for it to end, so "
                        "that the cache keeps what the aborted requests computed (signal again to exit now)", timeout_s)
            while self.alive and not self._hurried.is_set():
                self._thread.join(HURRY_POLL_S)
        if self.alive:
            log.warning("stopping while the engine thread is inside a step: what its requests computed is not "
                        "written to the disk or remote cache")

    def hurry(self) -> None:
        """Make `stop()` give up waiting for a step once its timeout has passed (a repeated signal)."""
        self._hurried.set()

    # ---- the asyncio side -------------------------------------------------------------------------

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result (or raise its error)."""
        if not self.alive:
            raise EngineFailure("the engine thread is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                value, error = fn(self.engine), None
            except Exception as e:
                value, error = None, e
            _post(loop, _settle, fut, value, error)

        self._commands.put(run)
        return await fut

    async def submit(self, sub: Submission) -> RequestStream:
        """Tokenize the request in a worker thread, then add it to the engine. Raises what tokenizing and
        add_request raise (RequestTooLarge, QueueFull, SamplingError, ChatTemplateError, ValueError),
        or ServerShuttingDown while draining."""
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        prompt = await self.tokenize(sub)
        grammar = await self.compile_grammar(sub.params)
        await self.prefetch(prompt, sub.params)
        try:
            await self.call(lambda engine: self._add(engine, sub, prompt, (loop, outputs), grammar))
        except asyncio.CancelledError:
            self.abort(sub.request_id)  # the add may still run after our caller went away
            raise
        stream = RequestStream(self, sub.request_id, outputs, loop)
        with self._streams_lock:
            self._streams.add(stream)
            deadline = self._expiry_s
        if deadline is not None:  # a drain began after the engine thread took the request
            stream.expire_at(deadline)
        return stream

    async def tokenize(self, sub: Submission) -> TokenizedPrompt:
        """The request's prompt rendered and tokenized by the offload workers (never the engine thread)."""
        if sub.tokenized is not None:
            return sub.tokenized
        try:
            return await self.offload.tokenize(sub.prompt, sub.messages, sub.template_kwargs, sub.message_starts)
        except PromptTooLong as e:
            raise RequestTooLarge(str(e)) from None
        except WorkersClosed:  # the server is stopping
            raise ServerShuttingDown("The server is shutting down and takes no new requests.") from None

    async def compile_grammar(self, params: SamplingParams) -> Grammar | BudgetedGrammar | None:
        """The request's grammar (response_format, forced or strict tools, thinking budget), compiled in a
        worker thread: llguidance takes seconds on a large schema (8,000 optional properties: 6 s), with the
        interpreter lock released, and on the engine thread every stream stopped for that long."""
        if params.structured is None:
            return None
        return await asyncio.to_thread(self.engine.grammars.compile, params.structured)

    async def prefetch(self, prompt: TokenizedPrompt, params: SamplingParams) -> None:
        """Wait for the cache's lookup of the prompt in a slow tier (the remote one), started here, off the
        engine thread: admission then finds the answer ready and never waits on Redis (PrefixCache.prefetch
        is safe from any thread; a Redis that is down or slow answers a miss within its timeout)."""
        future = (self.engine.prefetch(prompt.token_ids, prompt.message_starts, params.cache_salt)
                  if params.cache_prompt else None)
        if future is not None:
            await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Abort a request and free its memory, unless it already finished (then nothing happens)."""
        self._commands.put(lambda: self._abort(request_id, None))

    # ---- the engine thread ------------------------------------------------------------------------

    def _add(self, engine: Engine, sub: Submission, prompt: TokenizedPrompt, sink: Sink,
             grammar: Grammar | BudgetedGrammar | None = None) -> None:
        if self._draining:
            raise ServerShuttingDown("The server is shutting down and takes no new requests.")
        params = sub.params
        if sub.fit_max_tokens:  # max_tokens = the context the prompt leaves (at least 1: too long is refused)
            params = dataclasses.replace(params, max_tokens=max(1, engine.max_model_len - len(prompt.token_ids)))
        engine.add_request(prompt, params, request_id=sub.request_id, grammar=grammar)
        self._sinks[sub.request_id] = sink

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_commands(block=not self.engine.has_unfinished())
                self._abort_if_past_deadline()
                self.stalled = self.engine.stalled()
                if self._stopping or not self.engine.has_unfinished():
                    continue
                self._step()
                if not self.engine.has_unfinished():
                    self._check_idle_integrity()
        finally:
            self._abort_all(_aborted_at_shutdown())
            self._run_commands(block=False)  # settle calls that raced with the stop
            self.engine.close()  # release the disk cache's lock and files
            log.info("engine thread stopped")

    def _run_commands(self, block: bool) -> None:
        """Run queued commands; when `block`, first sleep until one arrives (or the drain deadline)."""
        if block:
            deadline = self._drain_deadline_s
            timeout_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                command = self._commands.get(timeout=timeout_s)
            except queue.Empty:
                return
            command()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()  # (none raises: `call` hands fn's error to its caller, `_abort` logs the engine's)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.num_step_failures += 1
            self.num_failed_steps_in_row += 1
            log.exception("engine.step() failed; failing the requests it was running and continuing")
            self._fail_after_step_error(e)
            return
        self.num_failed_steps_in_row = 0
        self._deliver(outputs)

    def _fail_after_step_error(self, e: Exception) -> None:
        if isinstance(e, StepFailed):  # the engine freed the requests the step touched: fail those alone
            failure = EngineFailure(f"The engine failed while running this request: {e}")
            for request_id in e.request_ids:
                self._abort(request_id, failure)
            return
        failure = EngineFailure(f"The engine failed while running this request: {type(e).__name__}: {e}")
        request_ids = self.engine.running_request_ids() or list(self._sinks)
        for request_id in request_ids:
            self._abort(request_id, failure)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
        for out in outputs:
            done = out.request_finished or out.error is not None
            sink = self._sinks.pop(out.request_id, None) if done else self._sinks.get(out.request_id)
            if sink is not None:
                item = EngineFailure(f"The engine failed this request: {out.error}") if out.error else out
                by_loop[sink[0]].append((sink[1], item))
        for loop, items in by_loop.items():
            _post(loop, _put_all, items)

    def _abort(self, request_id: str, reason: BaseException | None) -> None:
        """Abort in the engine; tell the request's stream `reason` (None: its consumer is gone)."""
        sink = self._sinks.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("engine.abort(%s) failed", request_id)
        if sink is not None and reason is not None:
            _post(sink[0], _put_all, [(sink[1], reason)])

    def _abort_all(self, reason: BaseException) -> None:
        for request_id in list(self._sinks):
            self._abort(request_id, reason)

    def _abort_if_past_deadline(self) -> None:
        if self._drain_deadline_s is not None and time.monotonic() >= self._drain_deadline_s:
            if self._sinks:
                log.warning("shutdown timeout: aborting %d request(s) still running", len(self._sinks))
            self._abort_all(_aborted_at_shutdown())
            self._drain_deadline_s = None

    def _check_idle_integrity(self) -> None:
        """The engine's idle-time invariants; a violation is logged loudly but does not stop serving."""
        try:
            self.engine.check_integrity()
        except Exception:
            log.exception("engine bookkeeping is inconsistent while idle")
