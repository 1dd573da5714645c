"""The in-process runner: a workload's requests through a real Engine, one at a time.

What it is: `EngineRunner(config)` builds an Engine (and sends it one uncached warm-up request, so
one-time start-up costs do not land on the first measured request), serves each request greedily
with end-of-sequence ignored (or, for a request `until_end_of_turn`, until the model ends its
turn; a request's `tools` go to the chat template), and measures time to first token as wall time from
`add_request` to the step that returns the request's first token. `restart()` drops the engine and builds a fresh
one from the same config (so on the same disk cache directory, when the config names one), as a
server restart would. `snapshots()` reads the cache's radix tree.

What it is not: a scheduler test. Requests never overlap, so batching plays no part in the figures.
"""

from __future__ import annotations

import time

from cairn.bench.conversation import BenchRequest
from cairn.bench.record import SnapshotPoint
from cairn.bench.run import Served
from cairn.config import EngineConfig
from cairn.engine.engine import Engine
from cairn.engine.outputs import Completion, accumulate
from cairn.request.sampling_params import SamplingParams

WARM_UP_PROMPT = "warm up"


class EngineRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = self._start()
        self.tokenizer = self.engine.tokenizer

    def _start(self) -> Engine:
        engine = Engine(self.config, show_progress=False)
        engine.add_request(WARM_UP_PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                          cache_prompt=False))
        while engine.has_unfinished():
            engine.step()
        return engine

    def serve(self, request: BenchRequest) -> Served:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0,
                                ignore_eos=not request.until_end_of_turn)
        template_kwargs = {"tools": request.tools} if request.tools else {}
        prompt_ids = self.engine.tokenize_chat(request.messages, **template_kwargs)[0]
        start_s = time.perf_counter()
        request_id = self.engine.add_request(None, params, messages=request.messages, template_kwargs=template_kwargs)
        ttft_s, final = self._until_finished(request_id, start_s)
        if final.error:
            raise RuntimeError(f"{request.label}: the engine failed the request: {final.error}")
        return Served(prompt_ids, list(final.token_ids), final.text, ttft_s, final.cache)

    def _until_finished(self, request_id: str, start_s: float) -> tuple[float, Completion]:
        ttft_s, answers = None, {}
        while True:
            assert self.engine.has_unfinished(), request_id  # the engine finishes every request it holds
            for out in self.engine.step():
                assert out.request_id == request_id, out.request_id  # one request at a time (the warm-up finished)
                if ttft_s is None and out.delta_token_ids:
                    ttft_s = time.perf_counter() - start_s
                answer = accumulate(answers, out)
                if out.finished:
                    return (ttft_s if ttft_s is not None else time.perf_counter() - start_s), answer

    def restart(self) -> None:
        self._stop()
        self.engine = self._start()
        self.tokenizer = self.engine.tokenizer

    def snapshots(self) -> list[SnapshotPoint]:
        tree = getattr(self.engine.cache, "tree", None)  # the NullCache of policy "none" has no tree
        if tree is None:
            return []
        points = []
        for pos, entry, _ in tree.iter_snapshots():
            tiers = snapshot_tiers(self.engine.cache, entry)
            points.append(SnapshotPoint(pos, entry.source, tiers[0] if tiers else "none", tiers))
        return sorted(points, key=lambda p: (p.position, p.source))

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.engine is not None:
            self.engine.close()  # releases the disk tier's files and lock, as a server's shutdown does
        self.engine = None


def snapshot_tiers(cache, entry) -> list[str]:
    """The tiers holding copies of a snapshot, fastest first (the tiered cache's handle maps them)."""
    return [tier.name for tier in cache.tiers.holding(entry.handle.copies)]
