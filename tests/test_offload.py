"""Offload and its worker processes: large inputs are parsed and tokenized in a worker process, with
the same results as in a thread; a worker that dies fails only the job it was running and is
replaced; under pytest the workers never load torch."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing.process
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from cairn.errors import PromptTooLong
from cairn.request.prompt import tokenize_prompt
from cairn.request.tokenizer import ByteTokenizer
from cairn.server.engine_io.offload import Offload
from cairn.server.engine_io.workers import ProcessWorkers, WorkerDied, WorkersClosed

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo " * 20}]


def torch_loaded(_context, _body) -> bool:
    return "torch" in sys.modules


def slow_echo(_context, body: bytes, delay_s: float) -> bytes:
    time.sleep(delay_s)
    return body


def die(_context, _body) -> None:
    os._exit(3)


def pid(_context, _body) -> int:
    return os.getpid()


@pytest.fixture
def offload():
    off = Offload(ByteTokenizer(), max_model_len=1000, large_input_bytes=16)  # all but tiny inputs are "large"
    yield off
    off.close()


@pytest.fixture
def workers():
    pool = ProcessWorkers(2, context=None)
    yield pool
    pool.close()


def test_large_prompt_is_tokenized_in_a_worker_process_exactly_as_in_a_thread(offload):
    got = asyncio.run(offload.tokenize(None, MESSAGES, None))
    assert got == tokenize_prompt(ByteTokenizer(), None, MESSAGES)
    assert asyncio.run(offload.tokenize("a text prompt", None, None)).token_ids == list(b"a text prompt")
    assert asyncio.run(offload.run(torch_loaded, [])) is False


def test_too_long_prompt_is_refused_across_the_process_boundary(offload):
    with pytest.raises(PromptTooLong, match="context is 1000 tokens"):
        asyncio.run(offload.tokenize("x" * 100_000, None, None))


def test_large_json_body_is_parsed_in_a_worker_process_from_its_chunks(offload):
    body = json.dumps({"messages": MESSAGES}).encode()
    chunks = [body[i:i + 7] for i in range(0, len(body), 7)]
    assert asyncio.run(offload.parse_json(chunks)) == {"messages": MESSAGES}
    with pytest.raises(ValueError):
        asyncio.run(offload.parse_json([b'{"messages": [', b" " * 100]))


def test_chunks_are_let_go_as_they_are_sent_so_no_single_free_releases_the_whole_body(workers):
    chunks = [b"a" * 1000, b"b" * 1000, b"c"]
    assert asyncio.run(workers.run(slow_echo, chunks, 0.0)) == b"a" * 1000 + b"b" * 1000 + b"c"
    assert chunks == []


def test_worker_that_dies_fails_only_its_own_job_and_is_replaced(workers):
    async def both():
        return await asyncio.gather(workers.run(slow_echo, [b"still ", b"here"], 1.0), workers.run(die, []),
                                    return_exceptions=True)

    survived, died = asyncio.run(both())
    assert survived == b"still here"
    assert isinstance(died, WorkerDied) and "exit code 3" in str(died)
    assert asyncio.run(workers.run(slow_echo, [b"next"], 0.0)) == b"next"


def test_worker_killed_while_idle_is_replaced_without_failing_the_next_job(workers):
    first = asyncio.run(workers.run(pid, []))  # the worker the next job gets (the idle ones are a stack)
    os.kill(first, signal.SIGKILL)
    time.sleep(0.5)  # (the kill is asynchronous)
    assert asyncio.run(workers.run(slow_echo, [b"served"], 0.0)) == b"served"
    assert asyncio.run(workers.run(pid, [])) != first


def test_worker_killed_a_moment_ago_that_still_looks_alive_does_not_fail_the_next_job(workers, monkeypatch, caplog):
    """A worker killed while idle can still look alive when the next job takes it (not yet reaped: the
    kill is asynchronous): the job's first send then finds the pipe closed, nothing was delivered, and
    the job runs on a new worker instead of failing (seen once in a served test on a loaded machine)."""
    first = asyncio.run(workers.run(pid, []))
    os.kill(first, signal.SIGKILL)
    stat = Path(f"/proc/{first}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # until dead (a zombie): its pipe end is closed
        time.sleep(0.01)
    # as it may look a moment after the kill:
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "is_alive", lambda self: True)
    with caplog.at_level(logging.WARNING, logger="cairn.server.engine_io.workers"):
        assert asyncio.run(workers.run(slow_echo, [b"served"], 0.0)) == b"served"
    assert asyncio.run(workers.run(pid, [])) != first
    assert any("died while idle" in r.getMessage() for r in caplog.records)


def test_closed_workers_refuse_new_jobs(workers):
    workers.close()
    with pytest.raises(WorkersClosed, match="shutdown"):
        asyncio.run(workers.run(pid, []))


def write_at_exit(_context, body: bytes) -> None:
    import atexit
    atexit.register(Path(body.decode()).write_text, "exited")


def stuck(_context, _body) -> None:
    import atexit
    atexit.register(time.sleep, 60)  # its exit never ends


def test_closed_pool_lets_its_idle_worker_exit_by_itself_so_its_exit_handlers_run(workers, tmp_path):
    """Closing the pool closes each idle worker's pipe: its loop ends and the process exits normally
    (exit handlers run: coverage's data, logs flushed), instead of being killed on the spot."""
    marker = tmp_path / "exited"
    asyncio.run(workers.run(write_at_exit, [str(marker).encode()]))
    workers.close()
    assert marker.read_text() == "exited"


def test_closed_worker_that_does_not_end_is_killed(workers):
    """A worker whose exit does not end within WORKER_EXIT_S once its pipe is closed is killed and reaped."""
    worker = asyncio.run(workers.run(pid, []))
    asyncio.run(workers.run(stuck, []))  # the same worker (the idle ones are a stack)
    workers.close()
    assert not Path(f"/proc/{worker}").exists()  # killed and reaped, not left sleeping its 60 s


def unpicklable(_context, _body):
    return lambda: None  # a result that cannot cross the process boundary


def test_result_that_does_not_pickle_fails_that_job_only(workers):
    with pytest.raises(RuntimeError, match="not picklable"):
        asyncio.run(workers.run(unpicklable, []))
    assert asyncio.run(workers.run(slow_echo, [b"next"], 0.0)) == b"next"


def slow_die(_context, _body, delay_s: float) -> None:
    time.sleep(delay_s)
    os._exit(3)


def slow_pid(_context, _body, delay_s: float) -> int:
    time.sleep(delay_s)
    return os.getpid()


def close_during(pool: ProcessWorkers, fn, *args):
    """Run fn in one worker and close the pool while it runs; the job's answer or exception."""
    async def run():
        job = asyncio.ensure_future(pool.run(fn, [], *args))
        await pool.run(pid, [])  # on the other worker: both are started by now
        await asyncio.sleep(0.3)
        pool.close()
        (answer,) = await asyncio.gather(job, return_exceptions=True)
        return answer
    return asyncio.run(run())


def test_job_running_when_the_pool_closes_still_answers_then_its_worker_stops(workers):
    worker = close_during(workers, slow_pid, 1.0)
    assert isinstance(worker, int)
    assert not Path(f"/proc/{worker}").exists()  # stopped and reaped once it answered, not put back


def test_worker_dying_while_the_pool_closes_fails_its_job_and_is_not_replaced(workers, caplog):
    with caplog.at_level(logging.ERROR, logger="cairn.server.engine_io.workers"):
        died = close_during(workers, slow_die, 1.0)
    assert isinstance(died, WorkerDied) and "exit code 3" in str(died)
    assert not any("starting another" in r.getMessage() for r in caplog.records)
