"""Engine: model, memory pools, scheduler, prefix cache and runner behind add_request / step / abort.

The parts are built at start-up by cairn/engine/build.py (build_parts); this file is what the engine does with
them.

The engine is single-threaded: one caller drives `step()` (the offline `LLM` in cairn/engine/llm.py, or the server's
engine thread). Each step schedules a batch, runs it, has the scheduler apply it, samples, and returns
a RequestOutput for every request that produced text or finished: what the step added (its token, text
and logprobs), never the whole answer again, so a step's output does not grow with the answer's
length; `LLM` and the server accumulate them (`outputs.Completion`).

A request with n > 1 is n sequences (choices) of one request id. The first computes the prompt; the
others are queued once its prefill is done and resume from the prompt-end snapshot it left in the
prefix cache (KV pages shared, state and logits copied), so the prompt is computed once. With the
prefix cache off (or `cache_prompt: false`) the n choices are queued together and each computes it.

Sampling problems stay with their request: a row that cannot be sampled, or a token its grammar
refuses, finishes that request with finish_reason "error" (RequestOutput.error says why); the rest
of the batch continues.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from typing import Any

from cairn.cache.base import NullCache, PrefixCache, ProbeResult
from cairn.cache.stats import CacheStats
from cairn.config import EngineConfig
from cairn.decode_graphs import CaptureBackend
from cairn.engine.activity import ActivityLog
from cairn.engine.build import build_parts
from cairn.engine.choices import ChoiceGroups
from cairn.engine.outputs import Detokenizer, RequestOutput
from cairn.errors import RequestTooLarge, SamplingError
from cairn.request.grammar import BudgetedGrammar, Grammar, allowed_masks_isolated
from cairn.request.logits import PenaltyCounts, RowContext
from cairn.request.prompt import PromptTooLong, TokenizedPrompt, tokenize_prompt
from cairn.request.sampling import Sampled, sample_isolated
from cairn.request.sampling_params import SamplingParams
from cairn.scheduler import ScheduledBatch, SequenceFailed
from cairn.sequence import Sequence, Status

log = logging.getLogger("cairn.engine")  # the name of the engine's log lines (README), not the module path


class StepFailed(RuntimeError):
    """engine.step() raised (its __cause__); the requests it touched (`request_ids`) were aborted and every
    resource they held is free again. Other requests are untouched and keep running."""

    def __init__(self, cause: BaseException, request_ids: list[str]):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


def check_prompt_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Raise RequestTooLarge for a prompt holding a token id outside [0, vocab_size): add_request's check,
    which the server's cache probe makes too (it answers for a prompt it never adds)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise RequestTooLarge(f"prompt token ids must be in [0, {vocab_size})")


def _breakpoints(prompt: TokenizedPrompt) -> dict[int, int]:
    """The prompt's cache breakpoints as the cache takes them: position -> TTL in seconds (the longest of those
    that share a position)."""
    ttls: dict[int, int] = {}
    for b in prompt.breakpoints:
        ttls[b.position] = max(ttls.get(b.position, 0), b.ttl_s)
    return ttls


class Engine:
    def __init__(self, config: EngineConfig, cache: PrefixCache | None = None, show_progress: bool = True,
                 graph_backend: CaptureBackend | None = None):
        """Build the engine's parts (build.build_parts: `cache` replaces the one config.cache describes;
        `graph_backend` takes the decode graph path on whatever the device)."""
        parts = build_parts(config, cache, show_progress, graph_backend)
        self.config, self.device, self.dtype = parts.config, parts.device, parts.dtype
        self.cpu_path, self.platform = parts.cpu_path, parts.platform
        self.model, self.model_config, self.model_name = parts.model, parts.model_config, parts.model_name
        self.weight_layout = parts.weight_layout
        self.tokenizer, self.grammars, self.sampling_defaults = parts.tokenizer, parts.grammars, parts.sampling_defaults
        self.kv, self.states, self.cache = parts.kv, parts.states, parts.cache
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.max_model_len, self.prefill_block = parts.max_model_len, parts.prefill_block
        self._special_ids = frozenset(self.tokenizer.special_tokens.values())  # never a stop token's text; no text at
        #   all with skip_special_tokens (see _hidden_ids)
        self.activity = ActivityLog(self.config.logging.log_stats_interval_s)
        self._detok: dict[str, Detokenizer] = {}
        self._seqs: dict[str, Sequence] = {}  # by sequence id: every unfinished choice
        self.choices = ChoiceGroups()  # each request's choices (n > 1), and those held for the first's prefill
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_chat(self, messages: list[dict[str, Any]], **template_kwargs) -> tuple[list[int], list[int]]:
        """Token ids of the rendered chat and where each message starts (see Tokenizer.encode_chat)."""
        return self.tokenizer.encode_chat(messages, **template_kwargs)

    def add_request(self, prompt: str | list[int] | TokenizedPrompt | None, params: SamplingParams, *,
                    request_id: str | None = None, messages: list[dict[str, Any]] | None = None,
                    template_kwargs: dict | None = None, message_starts: list[int] | None = None,
                    grammar: Grammar | BudgetedGrammar | None = None) -> str:
        """Queue a request: a text prompt, token ids, chat messages, or a prompt already tokenized by
        `tokenize_prompt` (then no tokenizer work happens here). Raises on input that can never run.
        `message_starts`: with token ids, where chat messages start in them (the cache snapshots there).
        `grammar`: params.structured already compiled by `self.grammars` (the server compiles it off the
        engine thread: a large schema takes seconds); else it is compiled here."""
        if not isinstance(prompt, TokenizedPrompt):
            try:
                prompt = tokenize_prompt(self.tokenizer, prompt, messages, template_kwargs, self.max_model_len,
                                         message_starts)
            except PromptTooLong as e:
                raise RequestTooLarge(str(e)) from None
        ids = prompt.token_ids
        if not ids:
            raise RequestTooLarge("the prompt is empty")
        self._check_token_ids(params)
        request_id = request_id or self.new_request_id()
        if request_id in self.choices:
            raise ValueError(f"request id {request_id!r} is already in use")
        if grammar is None and params.structured is not None:
            grammar = self.grammars.compile(params.structured)
        eos = () if params.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        seqs = [Sequence(request_id if i == 0 else f"{request_id}#{i}", ids if i == 0 else list(ids), params,
                         eos_token_ids=eos + params.stop_token_ids, message_starts=list(prompt.message_starts),
                         user_message_starts=list(prompt.user_message_starts), breakpoints=_breakpoints(prompt),
                         group_id=request_id, index=i,
                         grammar=grammar if i == 0 or grammar is None else grammar.fork())
                 for i in range(params.n)]
        self.scheduler.check_fits(seqs[0])  # before looking at every id: a huge prompt is refused at once
        check_prompt_token_ids(ids, self.model_config.vocab_size)
        hold = self._shares_prompt(params)
        for seq in seqs[:1] if hold else seqs:
            self.scheduler.add(seq)
        hidden = self._hidden_ids(params)
        for seq in seqs:
            self._seqs[seq.request_id] = seq
            self._detok[seq.request_id] = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                                      hidden)
        self.choices.add(request_id, seqs, hold)
        return request_id

    def _hidden_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens whose text the output leaves out: with skip_special_tokens, the special tokens, but for
        those params.keep_special_tokens names (the markers a chat parser reads). Their ids stay in the output."""
        if not params.skip_special_tokens:
            return frozenset()
        special = self.tokenizer.special_tokens
        return self._special_ids.difference(special[t] for t in params.keep_special_tokens if t in special)

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise SamplingError(f"logit_bias token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise SamplingError(f"stop_token_ids must be in [0, {vocab})")

    def _shares_prompt(self, params: SamplingParams) -> bool:
        """The other choices of an n > 1 request can wait for the first and resume from the cache."""
        return params.n > 1 and params.cache_prompt and not isinstance(self.cache, NullCache)

    def _release_held(self, request_id: str) -> None:
        """The first choice has computed the prompt: queue the others next (they resume from the cache)."""
        held = self.choices.release(request_id)
        if held:
            self.scheduler.add_next(held)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort every unfinished choice of the request; the output of the first one aborted (None: unknown)."""
        outs = [self._abort_choice(seq) for seq in self.choices.cancel(request_id)]
        return outs[0] if outs else None

    def _abort_choice(self, seq: Sequence) -> RequestOutput:
        """Take one choice out of the scheduler (freeing what it holds) and finish it as "abort"."""
        self.scheduler.abort(seq.request_id)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self._log_finished(seq)
        return self._output(seq, "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def stalled(self) -> str | None:
        """Why the engine cannot make progress now (None when it can): every working state slot is held
        while no request runs, so nothing queued can ever be admitted."""
        if self.states.num_free == 0 and not self.scheduler.running:
            return "every working state slot is held while no request is running"
        return None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def running_request_ids(self) -> list[str]:
        """Ids of the requests in the running batch (the ones a failed step may have left half-done)."""
        return list(dict.fromkeys(seq.group_id for seq in self.scheduler.running))

    # ---- the prefix cache, asked outside a request (the server's probe and metrics) -----------------

    def prefetch(self, token_ids: list[int], message_starts: list[int], cache_salt: str | None = None
                 ) -> Future | None:
        """Any thread (the server calls it right after tokenizing, off the engine thread): start looking this
        prompt up in a tier that is slow to ask (the remote tier), so that its admission, or a probe, finds the
        answer ready and the engine thread never waits on Redis. Changes no request and nothing the scheduler
        holds: the answer is hung on the tree later, on the engine thread. Returns a Future, done once the answer
        is in (await it from any thread), or None when there is nothing to look up (no remote tier). `cache_salt`:
        the request's (SamplingParams.cache_salt), whose namespace alone is looked up."""
        return self.cache.prefetch(token_ids, message_starts, cache_salt)

    def probe(self, token_ids: list[int], cache_salt: str | None = None) -> ProbeResult:
        """Engine thread only, between steps: where a request with this prompt would resume now (position, tier,
        estimated seconds to the first token, what the remote tier holds). Locks, copies and loads nothing and never
        waits for Redis: it hangs on the tree what a finished lookup of the prompt found, as admission would, and
        starts one when none was (prefetch). The answer is a value, true when made: the next step may change it.
        The token ids are not checked here (check_prompt_token_ids). Under `cache_salt`, only what that salt's
        requests stored counts (SamplingParams.cache_salt)."""
        return self.cache.probe(token_ids, cache_salt)

    def cache_stats(self) -> CacheStats | None:
        """Engine thread only: the prefix cache's counters and gauges (cairn/cache/stats.py), copied now, so safe
        to read on any thread afterwards; None when the cache caches nothing (NullCache). Changes nothing."""
        return self.scheduler.cache_stats()

    def num_cached_pages(self) -> int:
        """Engine thread only: the KV pages the prefix cache references now (idle, free + cached == the pool's
        pages). Changes nothing."""
        return len(self.cache.page_refs())

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch. Raises StepFailed when anything in it raised, after aborting the
        requests it touched: the one being admitted, else the batch (else every running request)."""
        try:
            batch = self.scheduler.schedule()
        except SequenceFailed as e:
            raise self._fail([e.seq], e.__cause__) from e.__cause__
        except Exception as e:
            raise self._fail(list(self.scheduler.running), e) from e
        for seq in batch.preempted:
            log.info("preempted %s (KV pool full); it will be recomputed", seq.request_id)
        if batch.empty:
            return []
        try:
            return self._run(batch)
        except Exception as e:
            raise self._fail(batch.seqs + batch.ready, e) from e

    def _fail(self, seqs: list[Sequence], cause: BaseException) -> StepFailed:
        """Abort seqs after a failed step, with the other choices of their requests, freeing their slots,
        pages and cache locks. The StepFailed names the requests (group ids)."""
        group_ids = list(dict.fromkeys(seq.group_id for seq in seqs))
        queued = {id(s) for s in [*self.scheduler.waiting, *self.scheduler.running]}
        doomed = list(seqs)
        for gid in group_ids:  # held choices (never scheduled) hold nothing: only the queued ones are dropped
            doomed += [s for s in self.choices.forget(gid) if all(s is not d for d in doomed) and id(s) in queued]
        for seq in doomed:
            try:
                self.scheduler.drop(seq)
            except Exception:
                log.exception("freeing %s after a failed step raised too", seq.request_id)
            seq.finish_reason = "error"
            self._seqs.pop(seq.request_id, None)
            self._detok.pop(seq.request_id, None)
        return StepFailed(cause, group_ids)

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        started = time.perf_counter()
        logits, computed = self.runner.run(batch) if batch.seqs else (None, [])
        logits, to_sample = self.scheduler.after_step(batch, logits, computed, time.perf_counter() - started)
        contexts = self._contexts(to_sample)
        sampled = sample_isolated(logits, [s.params for s in to_sample], [s.generator for s in to_sample], contexts)
        outputs = [self._append(seq, s) for seq, s in zip(to_sample, sampled, strict=True)]
        self.activity.maybe_stats(self.pool_use, self.num_running, self.num_waiting)
        return [out for out in outputs if out is not None]

    def _contexts(self, seqs: list[Sequence]) -> list[RowContext | None] | None:
        """Per row, what its logits processors need; None for the rows that need none (most)."""
        contexts: list[RowContext | None] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            p = seq.params
            banned = seq.eos_token_ids if seq.num_output_tokens < p.min_tokens else ()
            if p.penalized or banned or seq.grammar is not None:
                if seq.penalty is None and (p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
                    seq.penalty = PenaltyCounts()  # kept up to date step by step (see cairn.request.logits)
                contexts[i] = RowContext(seq.token_ids, seq.num_prompt_tokens, banned, penalty=seq.penalty)
        constrained = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if constrained:
            masks = allowed_masks_isolated([seqs[i].grammar for i in constrained], self.model_config.vocab_size)
            for i, mask in zip(constrained, masks, strict=True):
                contexts[i].allowed = mask
        return contexts if any(c is not None for c in contexts) else None

    def _fail_request(self, seq: Sequence, error: str) -> RequestOutput:
        """Finish seq's whole request with finish_reason "error" (the rest of the batch is untouched)."""
        log.warning("request %s failed in sampling: %s", seq.group_id, error)
        for other in self.choices.cancel(seq.group_id):
            if other is not seq:
                self._abort_choice(other)
        self.scheduler.finish(seq, "error")
        self._log_finished(seq)
        out = self._output(seq, "")
        out.error = error
        return out

    def _append(self, seq: Sequence, s: Sampled) -> RequestOutput | None:
        if seq.is_finished:  # a choice failed earlier in this step and took its siblings with it
            return None
        if s.error is not None:
            return self._fail_request(seq, s.error)
        if seq.grammar is not None and s.token not in seq.eos_token_ids and not seq.grammar.accept(s.token):
            return self._fail_request(seq, f"the grammar refused token {s.token}: {seq.grammar.error}")
        now = time.monotonic()
        if seq.first_token_s is None:
            seq.first_token_s = now
            self._log_prefill(seq)
            self.activity.first_token(seq)
            if seq.index == 0:
                self._release_held(seq.group_id)
        seq.last_token_s = now
        self.activity.token()
        reason = self.scheduler.append(seq, s.token)
        is_stop_token = reason == "stop"
        if seq.grammar is not None and seq.grammar.done:
            if seq.num_output_tokens < seq.params.min_tokens:  # only end-of-sequence may follow, which min_tokens bans
                return self._fail_request(seq, f"the structured output ended after {seq.num_output_tokens} tokens, "
                                               f"before min_tokens ({seq.params.min_tokens})")
            reason = "stop"
        shown = not is_stop_token or (seq.params.include_stop_str_in_output and s.token not in self._special_ids)
        delta, hit = self._detok[seq.request_id].add(s.token if shown else None, final=reason is not None,
                                                     check_stop=seq.num_output_tokens >= seq.params.min_tokens)
        if hit:
            reason = "stop"
        if reason:
            self.scheduler.finish(seq, reason)
            self._log_finished(seq)
        return self._output(seq, delta, s)

    def _output(self, seq: Sequence, delta: str, s: Sampled | None = None) -> RequestOutput:
        """seq's news this step: `delta` text, and the token sampled (`s`, None when it ended without one:
        then the text held back for stop strings is flushed)."""
        finished = seq.status == Status.FINISHED
        request_finished = finished
        if finished:
            self._seqs.pop(seq.request_id, None)
            delta += self._detok.pop(seq.request_id).flush()
            request_finished = self.choices.finish(seq)
        ttft = None if seq.first_token_s is None else seq.first_token_s - seq.arrival_s
        return RequestOutput(
            request_id=seq.group_id, delta_text=delta, delta_token_ids=[] if s is None else [s.token],
            finished=finished, finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            delta_logprobs=[] if s is None or s.logprob is None else [s.logprob],
            delta_top_logprobs=[] if s is None or s.top_logprobs is None else [s.top_logprobs],
            cache=seq.cache, ttft_s=ttft, prompt_token_ids=seq.prompt_ids if finished else None, index=seq.index,
            request_finished=request_finished)

    def _log_finished(self, seq: Sequence) -> None:
        if self.config.logging.log_requests:
            self.activity.finished(seq)

    def pool_use(self) -> dict[str, float]:
        """Fraction of each pool in use: KV pages (the cache's included), working slots, snapshot tiers."""
        kv, states = self.kv, self.states
        use = {"kv_pool_use": 1 - kv.allocator.num_free / kv.num_pages,
               "working_slots_use": 1 - states.num_free / states.num_usable}
        stats = self.scheduler.cache_stats()
        for tier, used in (stats.snapshot_used_bytes.items() if stats is not None else ()):
            if stats.snapshot_budget_bytes.get(tier):
                use[f"{tier}_snapshots_use"] = used / stats.snapshot_budget_bytes[tier]
        return {k: round(v, 4) for k, v in use.items()}

    def _log_prefill(self, seq: Sequence) -> None:
        """One DEBUG line per request whose prefill just finished: what it computed and what the cache gave
        (the INFO line comes when it finishes, see cairn.engine.activity)."""
        c = seq.cache
        log.debug("prefill %s: new=%d cached=%d resume=%d tier=%s source=%s match=%d miss=%s snapshots=%d "
                 "ttft=%.3fs kv_free=%d/%d slots_free=%d/%d", seq.request_id, seq.num_computed - seq.num_cached,
                 c.cached_tokens, c.resume_position, c.resume_tier, c.resume_source, c.match_length, c.miss_reason,
                 c.snapshots_taken, seq.first_token_s - seq.arrival_s, self.kv.allocator.num_free, self.kv.num_pages,
                 self.states.num_free, self.states.num_slots)

    def close(self) -> None:
        """Abort what is running and release the cache's files and locks (call once, at shutdown)."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.abort(seq.group_id)
        self.scheduler.close()

    def check_integrity(self) -> None:
        """Pages, slots and the cache's bookkeeping agree: every page's refcount is the tree's references
        plus the running requests' page tables (the scheduler checks), and an idle engine holds no slot."""
        self.scheduler.check_integrity()
        if not self.scheduler.has_work and self.states.num_free != self.states.num_usable:
            raise AssertionError("an idle engine holds working state slots")

