"""LLM: the offline facade over one Engine: add requests, step until they finish, return whole answers.

What this is not: the engine (cairn/engine/engine.py drives the model, scheduler and cache step by step) or
the server (cairn/server/ streams the same RequestOutputs over HTTP).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cairn.config import EngineConfig, config_with_overrides, environment_defaults
from cairn.engine.engine import Engine
from cairn.engine.outputs import Completion, accumulate
from cairn.request.sampling_params import SamplingParams


class LLM:
    """Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    `model=None` is the built-in demo model. Keyword arguments override fields of the option groups
    of EngineConfig (e.g. `kv_cache_gib=2`, `page_size=32`, `max_num_seqs=8`). Without a `config`, the
    environment sets what it sets on the command line (CAIRN_CPU_ISA: `cpu_isa`) unless a keyword does.
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides):
        if config is None:  # the environment's defaults, as on the command line (CAIRN_CPU_ISA)
            overrides = {**environment_defaults(), **overrides}
        self.engine = Engine(config_with_overrides(config or EngineConfig(), model=model, **overrides))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list, params: SamplingParams | None = None) -> list[Completion]:
        """Outputs in prompt order (with n > 1, the n choices of each prompt in index order).
        `prompts`: one prompt or a list of strings / token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        return self._run(self._add_all(prompts, lambda prompt: self.engine.add_request(prompt, params)))

    def chat(self, conversations: list[list[dict]], params: SamplingParams | None = None) -> list[Completion]:
        """One output per conversation (a list of {"role", "content"} messages)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = params or SamplingParams()
        return self._run(self._add_all(conversations, lambda m: self.engine.add_request(None, params, messages=m)))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_all(self, items: list, add: Callable[[Any], str]) -> list[str]:
        """add(item) for each item (it queues a request, returning its id); when one is refused, abort the
        ones queued before it (else they would run, unread, inside the next call's batch) and raise."""
        ids: list[str] = []
        try:
            for item in items:
                ids.append(add(item))
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return ids

    def _run(self, ids: list[str]) -> list[Completion]:
        """The finished answers of these requests: in request order, each request's choices by index."""
        done: dict[tuple[str, int], Completion] = {}
        remaining = set(ids)
        while remaining:
            for out in self.engine.step():
                accumulate(done, out)
                if out.request_finished:
                    remaining.discard(out.request_id)
        order = {request_id: i for i, request_id in enumerate(ids)}
        finished = [c for c in done.values() if c.finished and c.request_id in order]
        return sorted(finished, key=lambda c: (order[c.request_id], c.index))
