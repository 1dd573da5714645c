"""Engine: model, memory pools, scheduler, prefix cache and runner behind add_request / step / abort.

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
from typing import Any

import torch

from cairn.cache.base import NullCache, PrefixCache
from cairn.cache.factory import build_cache
from cairn.config import CacheOptions, ConfigError, EngineConfig
from cairn.decode_graphs import CaptureBackend, DecodeGraphs
from cairn.engine.activity import ActivityLog
from cairn.engine.choices import ChoiceGroups
from cairn.engine.compat import compat_digest, kernel_platform, weights_digest
from cairn.engine.demo import DEMO_NAME, build_demo
from cairn.engine.outputs import Detokenizer, RequestOutput
from cairn.engine.sizing import resolve_sizes
from cairn.errors import RequestTooLarge, SamplingError
from cairn.grammar import BudgetedGrammar, Grammar, GrammarCompiler, allowed_masks_isolated
from cairn.logits import PenaltyCounts, RowContext
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.model.config import ModelConfig
from cairn.model.layout import apply_layout, lay_out_int8, prefill_kernels, quantize
from cairn.model.loader import load_checkpoint
from cairn.ops import cpu_gemv, cpu_isa, cuda_graphs, load_fused_cpu_ops, select_kernels
from cairn.ops.gdn import CHUNK_SIZE as GDN_CHUNK
from cairn.prompt import PromptTooLong, TokenizedPrompt, tokenize_prompt
from cairn.runner import ModelRunner
from cairn.sampling import Sampled, SamplingParams, generation_defaults, generation_eos_ids, sample_isolated
from cairn.scheduler import ScheduledBatch, Scheduler, SequenceFailed
from cairn.sequence import Sequence, Status
from cairn.tokenizer import HFTokenizer

log = logging.getLogger("cairn.engine")  # the name of the engine's log lines (README), not the module path


class StepFailed(RuntimeError):
    """engine.step() raised (its __cause__); the requests it touched (`request_ids`) were aborted and every
    resource they held is free again. Other requests are untouched and keep running."""

    def __init__(self, cause: BaseException, request_ids: list[str]):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


def resolve_device(name: str) -> torch.device:
    """The torch device of `--device` (ModelOptions checked its form); ConfigError for a CUDA device torch
    does not see here, rather than torch's own error from the first tensor put on it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(f"--device {name}: no CUDA device {'here' if count == 0 else 'of that index'} "
                              f"(torch sees {count}; torch {torch.__version__})")
    return device


def prefill_block(requested: int | None, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The exact-resumption block (SchedulerOptions.prefill_block), 0 when off.

    A step must fit a whole block next to a decode token of every other running request, so that no
    block is ever split. Default: 512 (or the largest multiple of 64 that fits) in half precision, where
    a rounding difference changes the output visibly; off in float32."""
    room = (max_num_batched_tokens - max_num_seqs) // GDN_CHUNK * GDN_CHUNK
    if requested is None:
        block = min(512, room) if dtype in (torch.bfloat16, torch.float16) else 0
        if dtype != torch.float32 and block < GDN_CHUNK:
            log.warning("max_num_batched_tokens=%d leaves no room for a %d-token prefill block: resumed requests "
                        "will match cold ones only within rounding", max_num_batched_tokens, GDN_CHUNK)
        return max(block, 0)
    if requested and (requested % GDN_CHUNK or requested > room):
        raise ConfigError(f"--prefill-block {requested}: must be a multiple of {GDN_CHUNK} and at most "
                          f"--max-num-batched-tokens minus --max-num-seqs = {max_num_batched_tokens - max_num_seqs}")
    return requested


def check_prompt_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Raise RequestTooLarge for a prompt holding a token id outside [0, vocab_size): add_request's check,
    which the server's cache probe makes too (it answers for a prompt it never adds)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise RequestTooLarge(f"prompt token ids must be in [0, {vocab_size})")


class Engine:
    def __init__(self, config: EngineConfig, cache: PrefixCache | None = None, show_progress: bool = True,
                 graph_backend: CaptureBackend | None = None):
        """graph_backend: the decode graph path with this capture backend whatever the device (the CPU tests give
        the checking stand-in, cairn.ops.graph_check); `--cuda-graphs` gives CudaGraphBackend on CUDA."""
        self.config = config
        opts = config.model
        self.device = resolve_device(opts.device)
        if self.device.type == "cpu":
            # Decayed recurrent states underflow into subnormal floats, which x86 CPUs compute up to
            # 100x slower; flushing them to zero changes no result beyond 1e-38 and is set once here.
            torch.set_flush_denormal(True)
        torch.manual_seed(opts.demo_seed)
        if opts.model is None:
            dtype = torch.float32 if opts.dtype == "auto" else getattr(torch, opts.dtype)
            self.model, self.model_config, self.tokenizer = build_demo(dtype, self.device, opts.demo_seed)
            self.model_name = DEMO_NAME
            self.sampling_defaults: dict = {}
        else:
            self.model, self.model_config = load_checkpoint(opts.model, opts.dtype, self.device, show_progress)
            self.tokenizer = HFTokenizer(opts.model, self.model_config.eos_token_ids + generation_eos_ids(opts.model))
            self.model_name = opts.model
            self.sampling_defaults = generation_defaults(opts.model)
        if self.sampling_defaults:
            log.info("sampling defaults from generation_config.json (for fields a request leaves out): %s",
                     ", ".join(f"{k}={v}" for k, v in sorted(self.sampling_defaults.items())))
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self._special_ids = frozenset(self.tokenizer.special_tokens.values())  # never a stop token's text; no text at
        #   all with skip_special_tokens (see _hidden_ids)
        self.dtype = self.model.embed.weight.dtype
        quantize(self.model, self.model_config, opts.quantization, self.device)  # before the cache digests it
        self.cpu_path = self._cpu_path(opts.cpu_isa)
        # cairn's compiled CPU ops serve bf16 alone: other dtypes run the references whatever the path
        ops_path = self.cpu_path if self.dtype == torch.bfloat16 else "none"
        self.model.kernels = select_kernels(self.device, opts.fast_kernels, ops_path)
        self.config = config = resolve_sizes(config, self.device, is_demo=opts.model is None)
        backend = self._graph_backend(graph_backend)
        self.kv, self.states = self._allocate_pools(self.model_config, reserved_slots=int(backend is not None))
        sched = config.scheduler
        max_num_seqs = min(sched.max_num_seqs, self.states.num_slots - int(backend is not None))
        graphs = None if backend is None else DecodeGraphs(self.model, self.kv, self.states, backend, max_num_seqs,
                                                           self._max_model_len(reserved_pages=1))
        self.max_model_len = self._max_model_len()
        self.prefill_block = prefill_block(sched.prefill_block, self.dtype, sched.max_num_batched_tokens, max_num_seqs)
        # the weights' digest before the layout re-lays them (an int8 model's too: quantize made them); the
        # kernels the layout chose are part of the cache's compatibility digest (layout.prefill_kernels)
        weights = self._weights_digest(config.cache) if cache is None else ""
        # the exact-resume namespace's, and its start-up line's
        self.platform = kernel_platform(self.device, self.cpu_path)
        lay_out = apply_layout if opts.quantization == "none" else lay_out_int8
        self.weight_layout = lay_out(self.model, opts.weight_layout, self.dtype, self.device, cpu_path=self.cpu_path,
                                     path_forced=opts.cpu_isa != "auto")
        self.cache = cache if cache is not None else self._build_cache(config.cache, weights)
        self.scheduler = Scheduler(self.kv.allocator, self.kv.page_size, self.states, self.cache, max_num_seqs,
                                   sched.max_num_batched_tokens, self.max_model_len, sched.max_waiting,
                                   self.prefill_block, self.model.attention_break_even(), GDN_CHUNK)
        self.runner = ModelRunner(self.model, self.kv, self.states, self.device, self.prefill_block, graphs)
        if self.scheduler.attention_break_even:
            log.info("prefill beside decoding streams: a token at position p takes 1 + p / %d of the step's token "
                     "budget (from that position its attention costs more than its weights)",
                     self.scheduler.attention_break_even)
        if self.prefill_block:
            log.info("exact resumption: prefill in blocks of %d tokens, resumed at their ends; stored states are "
                     "shared only with the same platform (%s)", self.prefill_block, self.platform)
        load_fused_cpu_ops(self.model.kernels, self.dtype, self.device)  # built before /health answers, not mid-request
        self.activity = ActivityLog(config.logging.log_stats_interval_s)
        self._detok: dict[str, Detokenizer] = {}
        self._seqs: dict[str, Sequence] = {}  # by sequence id: every unfinished choice
        self.choices = ChoiceGroups()  # each request's choices (n > 1), and those held for the first's prefill
        self._ids = itertools.count()

    # ---- set-up -----------------------------------------------------------------------------------

    def _cpu_path(self, requested: str) -> str:
        """The instruction path of cairn's compiled CPU ops (cairn/ops/cpu_isa.py) for `requested` (--cpu-isa), said
        in one line: none off a CPU. Where the ops cannot be built here (no compiler, no ninja, a failed build: the
        gemv kernel's build tells, and a bf16 model builds it anyway), none too, said in that one line, so that no
        other op tries to build."""
        if self.device.type != "cpu":
            return "none"
        flags = cpu_isa.cpu_flags()
        path = cpu_isa.choose(requested, flags)
        if path != "none" and self.dtype == torch.bfloat16:
            built = cpu_gemv.load(flags, isa=None if requested == "auto" else path)
            if isinstance(built, str) and built.startswith("building"):
                log.warning("CPU path: none, the PyTorch reference kernels (%s)", built)
                return "none"
        log.info("%s", cpu_isa.described(path, requested, flags))
        return path

    def _weights_digest(self, opts: CacheOptions) -> str:
        """The weights' content digest when a disk or remote cache will need it ("" otherwise: it reads them all)."""
        if not self.model_config.recurrent_layers or not (opts.disk_cache or opts.remote_cache):
            return ""
        return weights_digest(self.model)

    def _build_cache(self, opts: CacheOptions, weights: str) -> PrefixCache:
        """The prefix cache, handed plain values: the compatibility digest is computed here, with a disk or
        remote cache (`weights`: the weights' digest, taken before the layout re-laid them)."""
        if not self.model_config.recurrent_layers:
            return NullCache()
        digest = compat_digest(weights, self.model_config, self.kv.k.dtype, self.kv.page_size, self.prefill_block,
                               prefill_kernels(self.model), self.platform) if weights else ""
        return build_cache(opts, self.kv, self.states, self.model_config.vocab_size, digest, self.model_name,
                           self.prefill_block)

    def _graph_backend(self, given: CaptureBackend | None) -> CaptureBackend | None:
        """The decode graph path's capture backend (None: off), after the refusals (ConfigError, one line); with
        it on, the model runs the graph-safe kernel set (cuda_graphs.graph_kernels)."""
        if given is None and not self.config.model.cuda_graphs:
            return None
        reason = ((cuda_graphs.device_refusal(self.device) if given is None else None)  # a given backend: any device
                  or cuda_graphs.refusal(self.model.kernels, self.model_config.ffn_types))
        if reason:
            raise ConfigError(reason)
        backend = given or cuda_graphs.CudaGraphBackend()
        self.model.kernels = cuda_graphs.graph_kernels(self.model.kernels)
        log.info("decode steps replay graphs (%s), captured per batch bucket on first use", backend.name)
        return backend

    def _allocate_pools(self, cfg: ModelConfig, reserved_slots: int = 0) -> tuple[KVPool, StatePool]:
        mem = self.config.memory
        n_attn = len(cfg.attention_layers)
        page_bytes = KVPool.page_bytes(max(n_attn, 1), mem.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        num_pages = mem.kv_cache_bytes // page_bytes
        if num_pages < 1:
            raise ConfigError(f"--kv-cache-gib {mem.kv_cache_gib} holds no KV page of {page_bytes} bytes")
        spec = cfg.state_spec(self.dtype)
        slot_bytes = spec.slot_bytes
        wanted = self.config.scheduler.max_num_seqs + reserved_slots  # reserved: the graph path's scratch slot
        num_slots = min(wanted, mem.state_cache_bytes // max(slot_bytes, 1))
        if num_slots < 1 + reserved_slots:
            raise ConfigError(f"--state-cache-gib {mem.state_cache_gib} holds no state slot of {slot_bytes} bytes")
        kv = KVPool(max(n_attn, 1), num_pages, mem.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        states = StatePool(spec, num_slots, self.device)
        log.info("KV pool: %d pages of %d tokens (%.1f MiB); %d working state slots of %.2f MiB",
                 num_pages, mem.page_size, kv.total_bytes / 2**20, num_slots, slot_bytes / 2**20)
        return kv, states

    def _max_model_len(self, reserved_pages: int = 0) -> int:
        """The longest prompt + output: --max-model-len, at most what the model and the KV pool (less the
        pages reserved, or `reserved_pages` a caller is about to reserve) hold. The engine's own call (without
        `reserved_pages`) warns, once, when that cuts the asked length."""
        usable = self.kv.num_pages - max(reserved_pages, len(self.kv.allocator.reserved))
        model_len, pool_len = self.model_config.max_position_embeddings, usable * self.kv.page_size
        limit = min(model_len, pool_len)
        asked = self.config.scheduler.max_model_len
        if asked and asked > limit and not reserved_pages:
            why = (f"the model's max_position_embeddings is {model_len}" if model_len <= pool_len else
                   f"the KV pool holds no more ({usable} pages of {self.kv.page_size} tokens); raise --kv-cache-gib "
                   "for a longer context")
            log.warning("--max-model-len %d cut to %d tokens: %s", asked, limit, why)
        return min(asked, limit) if asked else limit

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
                         user_message_starts=list(prompt.user_message_starts), group_id=request_id, index=i,
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
                    seq.penalty = PenaltyCounts()  # kept up to date step by step (see cairn.logits)
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

