"""SIGTERM / SIGINT on a real `cairn serve` process: it stops accepting, aborts the stream still running
after --shutdown-timeout-s with a last error event and [DONE], and exits 0 within a bounded time; and where
a second signal's drain runs (on the event loop, never inside the signal handler)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.server_process import start_server

SHUTDOWN_TIMEOUT_S = 1.0
EXIT_BOUND_S = SHUTDOWN_TIMEOUT_S + 2.0 + 6.0  # + uvicorn's grace + interpreter teardown (torch is slow to unload)


def stream_in_background(url: str, events: list[str], first_event: threading.Event) -> threading.Thread:
    body = {"prompt": "a long story", "max_tokens": 5000, "stream": True, "ignore_eos": True}

    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        first_event.set()
        except httpx.HTTPError as e:
            events.append(f"client error: {e!r}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def stops_accepting_within(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/health", timeout=0.5)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_mid_stream_aborts_it_and_exits_0_within_the_bound(sig):
    srv = start_server("--shutdown-timeout-s", str(SHUTDOWN_TIMEOUT_S), "--log-level", "WARNING")
    try:
        events: list[str] = []
        first_event = threading.Event()
        thread = stream_in_background(srv.base_url, events, first_event)
        assert first_event.wait(30), srv.log()
        start = time.monotonic()
        srv.signal(sig)
        assert stops_accepting_within(srv.base_url, SHUTDOWN_TIMEOUT_S)
        assert srv.proc.wait(EXIT_BOUND_S) == 0, srv.log()
        elapsed_s = time.monotonic() - start
        assert elapsed_s < EXIT_BOUND_S
        thread.join(5)
        assert events[-1] == "data: [DONE]", events[-3:]
        assert '"code":"shutting_down"' in events[-2]
    finally:
        srv.stop()


def test_second_sigterm_aborts_at_once_and_exits_0_without_a_traceback():
    srv = start_server("--shutdown-timeout-s", "60", "--log-level", "INFO")
    try:
        events: list[str] = []
        first_event = threading.Event()
        thread = stream_in_background(srv.base_url, events, first_event)
        assert first_event.wait(30), srv.log()
        srv.signal(signal.SIGTERM)
        assert stops_accepting_within(srv.base_url, 10)
        srv.signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log()  # far less than the 60 s the first signal allowed
        thread.join(5)
        assert events[-1] == "data: [DONE]" and '"code":"shutting_down"' in events[-2], events[-3:]
        log = srv.log()
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert "engine thread stopped" in log  # the engine (and its disk cache) was closed, not abandoned
    finally:
        srv.stop()


def test_request_whose_body_is_still_arriving_at_shutdown_ends_with_one_line_and_exit_0():
    """A client still sending its body when the server stops is no request of the engine's: nothing aborts
    it, so uvicorn cancels its task once the grace has passed; that is one log line, not a traceback."""
    import socket

    srv = start_server("--shutdown-timeout-s", "0.5", "--log-level", "INFO")
    try:
        port = int(srv.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")  # and the rest never comes
            time.sleep(1.0)  # the request's task is waiting for the body
            srv.signal(signal.SIGTERM)
            assert srv.proc.wait(30) == 0, srv.log()
        log = srv.log()
        assert "POST /v1/completions cancelled at shutdown" in log, log
        assert "Traceback" not in log and "CancelledError" not in log, log
    finally:
        srv.stop()


def test_a_second_signal_drains_on_the_event_loop_not_inside_the_signal_handler():
    """A Python signal handler runs between two bytecodes of the main thread, which may then hold a lock
    drain() takes (the bridge's streams lock in submit, its command queue's): draining inside the handler
    could deadlock the server. The second signal schedules the drain as the loop's next callback."""
    import asyncio

    import uvicorn

    from cairn.server.main import GracefulServer

    calls: list[str] = []
    server = GracefulServer(uvicorn.Config(app=None), lambda timeout_s: calls.append(f"drain {timeout_s}"), 5.0,
                            lambda: calls.append("hurry"))

    async def scenario() -> tuple[list[str], list[str]]:
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGTERM, None)
        inside_the_handler = list(calls)
        await asyncio.sleep(0)
        return inside_the_handler, list(calls)

    assert asyncio.run(scenario()) == ([], ["hurry", "drain 0.0"])
