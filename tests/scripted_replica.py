"""Test helper: a stand-in for a cairn replica whose answers a test scripts, for the router's fault paths.

A real `cairn serve` cannot be made on demand to answer its probe late or with garbage, to answer 503,
or to drop a connection before or in the middle of its answer; this HTTP server on a loopback port
does exactly one scripted thing per endpoint, so that a real `cairn router` process can be tested
against each fault. It is not a replica (no engine): its chat answer is a fixed JSON body or SSE
stream. Not a test module: it holds no assertions.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUSY_PADDING = 300_000  # bytes of padding in a 503 answer
GOOD_PROBE = {"position": 96, "est_ttft_s": 0.01, "waiting": 0, "running": 0, "tokens": 120}
ANSWER = {"id": "scripted", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "scripted"}, "finish_reason": "stop"}]}


@dataclass
class Script:
    health: int = 200  # status of GET /health
    probe: str = "good"  # good | missing (404) | garbage (not JSON) | slow (answers after `slow_s`)
    answer: str = "ok"  # ok | busy (503) | cut_before_body | cut_mid_stream | stream_without_usage
    slow_s: float = 3.0
    models: tuple[str, ...] = ("scripted",)  # what GET /v1/models lists
    generations: list[str] = field(default_factory=list)  # the paths of the generation requests received


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json", length: int | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/health":
            self._send(self.server.script.health, b'{"status": "scripted"}')
        elif self.path.startswith("/v1/models/"):
            name = self.path[len("/v1/models/"):]
            found = name in self.server.script.models
            self._send(200 if found else 404, json.dumps({"id": name, "object": "model"} if found else
                                                         {"error": {"message": f"no model {name}"}}).encode())
        else:
            data = [{"id": model, "object": "model"} for model in self.server.script.models]
            self._send(200, json.dumps({"object": "list", "data": data}).encode())

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        script = self.server.script
        if self.path.startswith("/v1/cache/probe"):  # (/v1/cache/probe/messages too)
            self._probe(script)
            return
        script.generations.append(self.path)
        if script.answer == "busy":  # a body longer than one read, as a replica's error page may be
            error = {"message": "scripted: busy", "type": "server_error", "detail": "." * BUSY_PADDING}
            self._send(503, json.dumps({"error": error}).encode())
        elif script.answer == "cut_before_body":  # headers promise a body that never comes
            self._send(200, b"", length=100)
            self.close_connection = True
        elif script.answer == "cut_mid_stream":  # the first event, then the connection drops
            first = b'data: {"choices": [{"index": 0, "delta": {"content": "half"}}]}\n\n'
            self._send(200, first, content_type="text/event-stream", length=len(first) + 1000)
            time.sleep(0.2)
            self.close_connection = True
        elif script.answer == "stream_without_usage":  # a whole stream, as a server ignoring include_usage sends
            events = b'data: {"choices": [{"index": 0, "delta": {"content": "scripted"}}]}\n\ndata: [DONE]\n\n'
            self._send(200, events, content_type="text/event-stream")
        else:
            self._send(200, json.dumps(ANSWER).encode())

    def _probe(self, script: Script) -> None:
        if script.probe == "missing":
            self._send(404, b'{"detail": "Not Found"}')
        elif script.probe == "garbage":
            self._send(200, b"<html>not json</html>", content_type="text/html")
        else:
            if script.probe == "slow":
                time.sleep(script.slow_s)
            self._send(200, json.dumps(GOOD_PROBE).encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script: Script):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = script


class ScriptedReplica:
    """`with ScriptedReplica(Script(...)) as r:` serves on r.url until the block ends."""

    def __init__(self, script: Script | None = None):
        self.script = script or Script()
        self._server = _Server(self.script)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedReplica:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering: the port then refuses connections."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
