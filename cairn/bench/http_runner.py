"""The HTTP runner: a workload's requests through a running `cairn serve`, one at a time.

What it is: `HTTPRunner(url, tokenizer)` posts each request to `/v1/chat/completions` as a stream
(greedy, `ignore_eos`, `logprobs` so that every token arrives in a chunk of its own, and
`stream_options.include_usage` for the last chunk's usage). Time to first token is wall time from
sending the request to the first chunk that carries a token. The cache report comes from
`usage.prompt_tokens_details.cached_tokens` and `usage.cairn` (resume position, tier, source, miss
reason, match length, snapshots taken).

The oracle needs the token ids the engine saw. The prompt is tokenized here with the server's
tokenizer and chat template (the demo's byte tokenizer, or `--tokenizer DIR`), and checked against
`usage.prompt_tokens`. The server returns text, not generated token ids, so the generated ids are
the text encoded again: exact when the text round-trips through the tokenizer; otherwise the oracle
may miss the part of an earlier reply past its first token that does not, which only matters when a
later prompt continues that reply verbatim.

What it is not: a load generator (see benchmarks/load.py), and it cannot restart the server.
"""

from __future__ import annotations

import json
import time

import httpx

from cairn.bench.conversation import BenchRequest
from cairn.bench.record import SnapshotPoint
from cairn.bench.run import Served
from cairn.request.tokenizer import Tokenizer
from cairn.sequence import CacheReport


class HTTPRunner:
    def __init__(self, url: str, tokenizer: Tokenizer, model: str | None = None, timeout_s: float = 3600.0,
                 client: httpx.Client | None = None):
        """`client`: an httpx.Client to use instead of one for `url` (e.g. a Starlette TestClient); not closed here."""
        self._owns_client = client is None
        self.client = client or httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
        self.tokenizer = tokenizer
        self.model = model or self.client.get("/v1/models").raise_for_status().json()["data"][0]["id"]

    def serve(self, request: BenchRequest) -> Served:
        if request.tools or request.until_end_of_turn:  # the text is rebuilt from content deltas: calls would be lost
            raise ValueError(f"{request.label}: the HTTP runner serves no requests with tools or until the end of "
                             "the turn: run this workload in-process")
        prompt_ids = self.tokenizer.encode_chat(request.messages)[0]
        body = {"model": self.model, "messages": request.messages, "max_tokens": request.max_tokens,
                "temperature": 0, "ignore_eos": True, "logprobs": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start_s = time.perf_counter()
        ttft_s, text, usage = None, [], None
        with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{request.label}: HTTP {response.status_code}: {response.read().decode()}")
            for chunk in _events(response):
                if "error" in chunk:
                    raise RuntimeError(f"{request.label}: the server failed the request: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    if ttft_s is None and (choice.get("logprobs") or {}).get("content"):
                        ttft_s = time.perf_counter() - start_s
                    text.append(choice.get("delta", {}).get("content") or "")
                usage = chunk.get("usage") or usage
        if usage is None:
            raise RuntimeError(f"{request.label}: the stream ended without usage")
        if usage["prompt_tokens"] != len(prompt_ids):
            raise RuntimeError(f"{request.label}: the server counted {usage['prompt_tokens']} prompt tokens, the local "
                               f"tokenizer {len(prompt_ids)}: pass --tokenizer with the server's checkpoint")
        reply = "".join(text)
        return Served(prompt_ids, self.tokenizer.encode(reply), reply, ttft_s or time.perf_counter() - start_s,
                      cache_report(usage))

    def snapshots(self) -> list[SnapshotPoint]:
        return []

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


def _events(response: httpx.Response):
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def cache_report(usage: dict) -> CacheReport:
    """The CacheReport a response's usage describes (OpenAI's cached_tokens plus cairn's extension)."""
    c = usage.get("cairn") or {}
    return CacheReport(cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                       resume_position=c.get("resume_position", 0), resume_tier=c.get("tier"),
                       resume_source=c.get("source"), match_length=c.get("match_length", 0),
                       miss_reason=c.get("miss_reason"), snapshots_taken=c.get("snapshots_taken", 0))
