"""Engine: model, memory pools, scheduler, prefix cache and runner behind add_request / step / abort.

The engine is single-threaded: one caller drives `step()` (the offline `LLM` below, or the server's
engine thread). Each step schedules a batch, runs it, samples, and returns a RequestOutput for every
request that produced text or finished.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from cairn.cache.base import PrefixCache
from cairn.cache.factory import build_cache
from cairn.config import EngineConfig
from cairn.demo import DEMO_NAME, build_demo
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.model.config import ModelConfig
from cairn.model.layout import apply_layout, quantize
from cairn.model.loader import load_checkpoint
from cairn.ops import select_kernels
from cairn.outputs import Detokenizer, RequestOutput
from cairn.runner import ModelRunner
from cairn.sampling import SamplingParams, sample
from cairn.scheduler import RequestTooLarge, Scheduler
from cairn.sequence import Sequence, Status
from cairn.tokenizer import HFTokenizer

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Engine:
    def __init__(self, config: EngineConfig, cache: PrefixCache | None = None, show_progress: bool = True):
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
        else:
            self.model, self.model_config = load_checkpoint(opts.model, opts.dtype, self.device, show_progress)
            self.tokenizer = HFTokenizer(opts.model, self.model_config.eos_token_ids)
            self.model_name = opts.model
        self.dtype = self.model.embed.weight.dtype
        quantize(self.model, self.model_config, opts.quantization, self.device)  # before the cache digests it
        if opts.fast_kernels:
            self.model.kernels = select_kernels(self.device, fast=True)
        self.kv, self.states = self._allocate_pools(self.model_config)
        self.max_model_len = self._max_model_len()
        self.cache = cache if cache is not None else build_cache(
            config.cache, self.model, self.model_config, self.kv, self.states)
        self.weight_layout = opts.quantization if opts.quantization != "none" else apply_layout(
            self.model, opts.weight_layout, self.dtype, self.device)  # after: packing keeps the numbers
        sched = config.scheduler
        self.scheduler = Scheduler(self.kv.allocator, self.kv.page_size, self.states, self.cache,
                                   min(sched.max_num_seqs, self.states.num_slots), sched.max_num_batched_tokens,
                                   self.max_model_len, sched.max_waiting)
        self.runner = ModelRunner(self.model, self.kv, self.states, self.device, self.cache)
        self._detok: dict[str, Detokenizer] = {}
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    # ---- set-up -----------------------------------------------------------------------------------

    def _allocate_pools(self, cfg: ModelConfig) -> tuple[KVPool, StatePool]:
        mem = self.config.memory
        n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
        page_bytes = KVPool.page_bytes(max(n_attn, 1), mem.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        num_pages = mem.kv_cache_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"kv_cache_gib={mem.kv_cache_gib} holds no page of {page_bytes} bytes")
        slot_bytes = StatePool.slot_bytes(n_lin, cfg.conv_dim, cfg.conv_kernel, cfg.linear_num_v_heads,
                                          cfg.linear_k_head_dim, cfg.linear_v_head_dim, self.dtype)
        num_slots = min(self.config.scheduler.max_num_seqs, mem.state_cache_bytes // max(slot_bytes, 1))
        if num_slots < 1:
            raise ValueError(f"state_cache_gib={mem.state_cache_gib} holds no state slot of {slot_bytes} bytes")
        kv = KVPool(max(n_attn, 1), num_pages, mem.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        states = StatePool(n_lin, num_slots, cfg.conv_dim, cfg.conv_kernel, cfg.linear_num_v_heads,
                           cfg.linear_k_head_dim, cfg.linear_v_head_dim, self.dtype, self.device)
        log.info("KV pool: %d pages of %d tokens (%.1f MiB); %d working state slots of %.2f MiB",
                 num_pages, mem.page_size, kv.total_bytes / 2**20, num_slots, slot_bytes / 2**20)
        return kv, states

    def _max_model_len(self) -> int:
        limit = min(self.model_config.max_position_embeddings, self.kv.num_pages * self.kv.page_size)
        asked = self.config.scheduler.max_model_len
        return min(asked, limit) if asked else limit

    # ---- requests ---------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_chat(self, messages: list[dict[str, Any]], **template_kwargs) -> tuple[list[int], list[int]]:
        return self.tokenizer.encode_chat(messages, **template_kwargs)

    def add_request(self, prompt: str | list[int] | None, params: SamplingParams, *, request_id: str | None = None,
                    messages: list[dict[str, Any]] | None = None, template_kwargs: dict | None = None) -> str:
        """Queue a request: a text prompt, token ids, or chat messages. Raises on input that can never run."""
        message_starts: list[int] = []
        user_starts: list[int] = []
        if messages is not None:
            ids, starts = self.tokenize_chat(messages, **(template_kwargs or {}))
            message_starts = sorted({p for p in starts if 0 < p < len(ids)})
            user_starts = [p for p, m in zip(starts, messages[1:], strict=False) if m.get("role") == "user"]
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt or [])
        if not ids:
            raise RequestTooLarge("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestTooLarge(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id or self.new_request_id()
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        eos = () if params.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        seq = Sequence(request_id, ids, params, eos_token_ids=eos + params.stop_token_ids,
                       message_starts=message_starts, user_message_starts=user_starts)
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        self._detok[request_id] = Detokenizer(self.tokenizer, params.stop)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.scheduler.abort(request_id)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return self._output(seq, "", [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def running_request_ids(self) -> list[str]:
        """Ids of the requests in the running batch (the ones a failed step may have left half-done)."""
        return [seq.request_id for seq in self.scheduler.running]

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            log.info("preempted %s (KV pool full); it will be recomputed", seq.request_id)
        if batch.empty:
            return []
        self.num_steps += 1
        started = time.perf_counter()
        logits, to_sample = self.runner.run(batch) if batch.seqs else (None, [])
        prefill_tokens = batch.num_tokens - batch.num_decode
        if prefill_tokens:
            self.cache.observe_prefill(prefill_tokens, time.perf_counter() - started)
        row_of = {seq.request_id: i for i, seq in enumerate(to_sample)}
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
            i = row_of.get(seq.request_id)
            self.cache.after_step(seq, None if i is None else logits[i])
        if batch.ready:
            restored = torch.stack([seq.ready_logits.float().cpu() for seq in batch.ready])
            logits = restored if logits is None else torch.cat([logits, restored])
            to_sample = to_sample + batch.ready
            for seq in batch.ready:
                seq.ready_logits = None
        sampled = sample(logits, [s.params for s in to_sample], [s.generator for s in to_sample])
        return [self._append(seq, s) for seq, s in zip(to_sample, sampled, strict=True)]

    def _append(self, seq: Sequence, s) -> RequestOutput:
        now = time.monotonic()
        if seq.first_token_s is None:
            seq.first_token_s = now
            self._log_prefill(seq)
        seq.last_token_s = now
        seq.token_ids.append(s.token)
        if s.logprob is not None:
            seq.logprobs.append(s.logprob)
        if s.top_logprobs is not None:
            seq.top_logprobs.append(s.top_logprobs)
        reason = None
        is_stop_token = s.token in seq.eos_token_ids
        if is_stop_token:
            reason = "stop"
        elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        delta, hit = self._detok[seq.request_id].add(None if is_stop_token else s.token, final=reason is not None)
        if hit:
            reason = "stop"
        if reason:
            self.scheduler.finish(seq, reason)
        return self._output(seq, delta, [s.token])

    def _output(self, seq: Sequence, delta: str, delta_ids: list[int]) -> RequestOutput:
        detok = self._detok[seq.request_id]
        finished = seq.status == Status.FINISHED
        if finished:
            self._seqs.pop(seq.request_id, None)
            self._detok.pop(seq.request_id, None)
        ttft = None if seq.first_token_s is None else seq.first_token_s - seq.arrival_s
        return RequestOutput(
            request_id=seq.request_id, text=detok.text[: detok.sent] if not finished else detok.text,
            delta_text=delta, token_ids=seq.output_ids, delta_token_ids=delta_ids, finished=finished,
            finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            logprobs=list(seq.logprobs), top_logprobs=list(seq.top_logprobs), cache=seq.cache, ttft_s=ttft)

    def _log_prefill(self, seq: Sequence) -> None:
        """One line per request whose prefill just finished: what it computed and what the cache gave."""
        c = seq.cache
        log.info("prefill %s: new=%d cached=%d resume=%d tier=%s source=%s match=%d miss=%s snapshots=%d "
                 "ttft=%.3fs kv_free=%d/%d slots_free=%d/%d", seq.request_id, seq.num_computed - seq.num_cached,
                 c.cached_tokens, c.resume_position, c.resume_tier, c.resume_source, c.match_length, c.miss_reason,
                 c.snapshots_taken, seq.first_token_s - seq.arrival_s, self.kv.allocator.num_free, self.kv.num_pages,
                 self.states.num_free, self.states.num_slots)

    def close(self) -> None:
        """Abort what is running and release the cache's files and locks (call once, at shutdown)."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.abort(seq.request_id)
        self.cache.close()

    def check_integrity(self) -> None:
        """Pages, slots and the cache's bookkeeping agree: every page's refcount is the tree's references
        plus the running requests' page tables."""
        self.cache.check_integrity()
        expected: dict[int, int] = dict(self.cache.page_refs())
        for seq in self.scheduler.running:
            for page in seq.page_table:
                expected[page] = expected.get(page, 0) + 1
        self.kv.allocator.check_integrity(expected)
        if not self.scheduler.has_work and self.states.num_free != self.states.num_slots:
            raise AssertionError("an idle engine holds working state slots")


class LLM:
    """Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    `model=None` is the built-in demo model. Keyword arguments override fields of the option groups
    of EngineConfig (e.g. `kv_cache_gib=2`, `page_size=32`, `max_num_seqs=8`).
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides):
        from cairn.cli import config_with_overrides

        self.engine = Engine(config_with_overrides(config or EngineConfig(), model=model, **overrides))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Outputs in prompt order. `prompts`: one prompt or a list of strings / token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.engine.add_request(p, params or SamplingParams()) for p in prompts]
        return self._run(ids)

    def chat(self, conversations: list[list[dict]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """One output per conversation (a list of {"role", "content"} messages)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.engine.add_request(None, params or SamplingParams(), messages=m) for m in conversations]
        return self._run(ids)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
