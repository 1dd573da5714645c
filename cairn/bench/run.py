"""Driving one workload through one runner: requests out, replies back, then the oracle and the rows.

What it is: the `Runner` interface both runners implement (in-process engine, HTTP server), the
`Served` record a runner returns per request, and `run_workload`, which feeds each reply back into
the workload's generator, serves requests strictly one at a time (so times to first token are
comparable across policies), and turns what was served into `RequestRecord`s with their oracle.

What it is not: a runner, or anything that knows about policies, files or plots.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cairn.bench.conversation import BenchRequest, Reply, Workload, WorkloadSizes
from cairn.bench.oracle import oracle_tokens
from cairn.bench.record import RequestRecord, SnapshotPoint, WorkloadResult
from cairn.bench.text import TextSource
from cairn.request.tokenizer import Tokenizer
from cairn.sequence import CacheReport


@dataclass
class Served:
    """One request as a runner served it."""

    prompt_ids: list[int]  # the prompt's token ids as the engine saw them
    output_ids: list[int]  # generated token ids (over HTTP: the returned text encoded again)
    text: str  # generated text, as the client receives it
    ttft_s: float  # wall time from submitting the request to its first token
    cache: CacheReport  # what the prefix cache did


class Runner(Protocol):
    tokenizer: Tokenizer  # the tokenizer (and chat template) the engine uses

    def serve(self, request: BenchRequest) -> Served: ...

    def restart(self) -> None:
        """Restart the server (a fresh engine over the same durable cache). Only workloads that need the
        disk tier restart, and the HTTP runner, which cannot restart a server, is never given one: it has
        no such method."""

    def snapshots(self) -> list[SnapshotPoint]:
        """The snapshots the cache holds now ([] when the runner cannot see them)."""

    def close(self) -> None: ...


def workload_seed(seed: int, name: str) -> int:
    """Each workload's own text seed (stable across runs and Python processes)."""
    return seed * 1_000_003 + zlib.crc32(name.encode())


def serve_stream(workload: Workload, runner: Runner, sizes: WorkloadSizes, seed: int
                 ) -> list[tuple[BenchRequest, Served]]:
    """Every request of the workload, served in order, each reply sent back before the next request."""
    stream = workload.build(sizes, TextSource(workload_seed(seed, workload.name), runner.tokenizer), runner.tokenizer)
    served: list[tuple[BenchRequest, Served]] = []
    request = next(stream)
    while True:
        if request.restart_before:
            runner.restart()
        result = runner.serve(request)
        served.append((request, result))
        try:
            request = stream.send(Reply(result.text))
        except StopIteration:
            return served


def to_records(served: list[tuple[BenchRequest, Served]]) -> list[RequestRecord]:
    oracle = oracle_tokens([s.prompt_ids for _, s in served], [s.prompt_ids + s.output_ids for _, s in served])
    rows = []
    for i, ((request, s), best) in enumerate(zip(served, oracle, strict=True)):
        c, n = s.cache, len(s.prompt_ids)
        rows.append(RequestRecord(
            index=i, label=request.label, conversation=request.conversation, prompt_tokens=n,
            cached_tokens=c.cached_tokens, computed_tokens=n - c.cached_tokens, oracle_tokens=best,
            resume_position=c.resume_position, resume_tier=c.resume_tier, resume_source=c.resume_source,
            match_length=c.match_length, miss_reason=c.miss_reason, snapshots_taken=c.snapshots_taken,
            output_tokens=len(s.output_ids), ttft_s=s.ttft_s, restarted_before=request.restart_before))
    return rows


def run_workload(workload: Workload, policy: str, make_runner: Callable[[], Runner], sizes: WorkloadSizes,
                 seed: int, skip_reason: str | None = None) -> WorkloadResult:
    """Serve `workload` through a fresh runner; `skip_reason` set: record the skip and run nothing."""
    if skip_reason:
        return WorkloadResult(workload.name, policy, skipped=skip_reason)
    runner = make_runner()
    try:
        served = serve_stream(workload, runner, sizes, seed)
        snapshots = runner.snapshots()
    finally:
        runner.close()
    return WorkloadResult(workload.name, policy, to_records(served), snapshots)
