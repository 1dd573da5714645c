"""Constrained output: grammars compiled by llguidance, one matcher per constrained request.

`GrammarCompiler` wraps the serving tokenizer once (a checkpoint's tokenizer.json, or the demo
model's byte tokenizer) and turns a StructuredOutput into a grammar: llguidance's matcher over the
token vocabulary. Each step the engine asks every constrained request's grammar for its mask of
allowed tokens (`allowed_masks`, one bool row per request, built from llguidance's 32-bit packed
bitmask), the sampler sets the others to -inf, and the chosen token is fed back (`accept`). When the
grammar is complete the matcher is `done` and the request finishes with "stop"; when max_tokens cuts
it first, it finishes with "length" and the text is unfinished.

What the output must be (the `answer` rule, in llguidance's Lark syntax):
    json_object / json_schema   response_format: one JSON value (`%json`)
    lark                        rules given by the caller (forced tool calls, `server.call_grammar`)
    text                        anything (only useful after a reasoning block, for its budget)
When the prompt ends inside a reasoning block (`think_end`: the text that ends it, e.g. `</think>`),
the reasoning comes first, free, and the answer only after its end text (up to two newlines between).
`think_budget` bounds the reasoning: after that many reasoning tokens a `BudgetedGrammar` switches to
a grammar that starts with the end text, so the end text is forced next and the answer follows.

Between JSON tokens at most one space or newline is allowed (WHITESPACE, Outlines' choice), so that
a schema with bounded strings, arrays and numbers bounds the output length even for a model with
random weights, and a model cannot spend its max_tokens on indentation. No whitespace comes before
or after the value.

What this is not: the sampler (`cairn.request.sampling`) or the processors that apply the mask (`cairn.request.logits`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections.abc import Callable

import torch

from cairn.errors import SamplingError
from cairn.request.sampling_params import StructuredOutput
from cairn.request.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

WHITESPACE = r"[\x20\x0A]?"  # what may separate JSON tokens
ANY_OBJECT = {"type": "object"}  # response_format json_object
KINDS = ("json_object", "json_schema", "lark", "text")
PARAM = {"json_object": "response_format", "json_schema": "response_format", "lark": "tools",
         "text": "thinking_token_budget"}  # the request field a kind comes from (named by a 400)
ANSWER_SEPARATOR = r"/\n{0,2}/"  # between the reasoning's end and a constrained answer

log = logging.getLogger("cairn.grammar")  # the name of its log lines, not the module path
MAX_ERROR_CHARS = 500  # of a grammar's error, as a request's error says it


def error_summary(error: str) -> str:
    """llguidance's error without what it appends to it: a failed step's parser state and grammar (`<state>...`),
    a failed compile's grammar source with the error marked (`   2 | answer: ...`), 100 KB and more for a large
    schema, which would go to every response and log line; its own lines joined by spaces, at most
    MAX_ERROR_CHARS characters."""
    kept = []
    for line in error.split("\n"):
        if line.startswith("<state>") or _SOURCE_LINE.match(line):
            break
        kept.append(line.strip())
    return " ".join(line for line in kept if line)[:MAX_ERROR_CHARS]


_SOURCE_LINE = re.compile(r"\s*\d+ \| ")


class Grammar:
    """One request's position in its grammar. Not thread-safe; used by the engine thread only."""

    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it (the matcher is then in error)."""
        try:
            return bool(self._matcher.consume_token(token))
        except Exception:  # llguidance failing on a token its mask allowed: the request fails, not the batch
            return False

    @property
    def done(self) -> bool:
        """The value is complete: nothing but end-of-sequence may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        """Why the matcher stopped (error_summary)."""
        return error_summary(self._matcher.get_error())

    def write_mask(self, row: torch.Tensor) -> None:
        """Write the allowed tokens into `row`, int32 [ceil(vocab / 32)], as llguidance's packed bits."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def fork(self) -> Grammar:
        """An independent copy at the same position (for the other choices of an n > 1 request)."""
        return Grammar(self._matcher.deep_copy())


class BudgetedGrammar:
    """A grammar whose reasoning block may take at most `budget` tokens: `thinking` (reasoning, its end,
    the answer) runs until the model ends the reasoning itself or has spent the budget; then `forced`
    (the end, the answer) takes over, so the end is forced next. `end` is the end's text as bytes,
    `decode` gives a token's bytes (how the end is seen when the model writes it)."""

    def __init__(self, thinking: Grammar, forced: Grammar, budget: int, end: bytes, decode: Callable[[int], bytes]):
        self._thinking, self._forced, self._left = thinking, forced, budget
        self._end, self._decode, self._tail = end, decode, b""
        self._now = forced if budget <= 0 else thinking

    def accept(self, token: int) -> bool:
        ok = self._now.accept(token)
        if ok and self._now is self._thinking and self._left:
            self._tail = (self._tail + self._decode(token))[-2 * len(self._end):]
            if self._end in self._tail:
                self._left = 0  # ended by the model: no budget to watch any more
            else:
                self._left -= 1
                self._now = self._thinking if self._left else self._forced
        return ok

    @property
    def done(self) -> bool:
        return self._now.done

    @property
    def error(self) -> str:
        return self._now.error

    def write_mask(self, row: torch.Tensor) -> None:
        self._now.write_mask(row)

    def fork(self) -> BudgetedGrammar:
        copy = BudgetedGrammar(self._thinking.fork(), self._forced.fork(), self._left, self._end, self._decode)
        copy._now = copy._forced if self._now is self._forced else copy._thinking
        copy._tail = self._tail
        return copy


class GrammarCompiler:
    """Compiles StructuredOutput specs against one tokenizer and vocabulary size. Thread-safe: the server
    compiles each request's grammar in a worker thread, several at once."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None  # llguidance.LLTokenizer (immutable, shared), built on first use
        self._ll_lock = threading.Lock()  # built once, not by each of the first concurrent compiles

    def compile(self, spec: StructuredOutput) -> Grammar | BudgetedGrammar:
        """A fresh grammar for `spec`. Raises SamplingError (a 400) on a schema llguidance cannot use."""
        answer = _answer_rules(spec)
        if spec.think_end is None:
            return self._grammar(f"start: answer\n{answer}", spec.kind)
        end = lark_tag(self._tokenizer, spec.think_end)
        sep = "" if spec.kind == "text" else " SEP"
        rules = f"SEP: {ANSWER_SEPARATOR}\n{answer}"
        if end.startswith("<["):  # one special token: anything but it (and end-of-sequence) before it
            others = ",".join(str(t) for t in (special_tokens(self._tokenizer)[spec.think_end],
                                                *self._tokenizer.eos_token_ids))
            thinking = f"start: think {end}{sep} answer\nthink: <[^{others}]>*\n{rules}"
        else:  # text: the reasoning ends at its first occurrence
            thinking = f"start: think{sep} answer\nthink[lazy]: THINK\nTHINK: /(?s:.*)/ {end}\n{rules}"
        if spec.think_budget is None:
            return self._grammar(thinking, spec.kind)
        forced = self._grammar(f"start: {end}{sep} answer\n{rules}", spec.kind)
        ll = self._lltokenizer()
        return BudgetedGrammar(self._grammar(thinking, spec.kind), forced, spec.think_budget, spec.think_end.encode(),
                               lambda t: ll.decode_bytes([t]))

    def _grammar(self, lark: str, kind: str) -> Grammar:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._lltokenizer(), LLMatcher.grammar_from_lark(lark), log_level=0)
        for m in (matcher, _forced_start(matcher)):
            if m.is_error():
                raise SamplingError(f"{PARAM.get(kind, 'response_format')} is not usable: "
                                    f"{error_summary(m.get_error())}")
        return Grammar(matcher)

    def _lltokenizer(self):
        with self._ll_lock:
            if self._ll is None:
                self._ll = _lltokenizer(self._tokenizer, self.vocab_size)
        return self._ll


def _answer_rules(spec: StructuredOutput) -> str:
    """Lark rules defining `answer`, what the output (after the reasoning, if any) must be."""
    if spec.kind == "lark":
        return spec.schema or ""
    if spec.kind == "text":
        return "answer: <[*]>*"  # any token, special ones included (a tool call's tags)
    if spec.kind == "json_object":
        schema: object = ANY_OBJECT
    elif spec.kind == "json_schema":
        try:
            schema = json.loads(spec.schema or "")
        except ValueError as e:
            raise SamplingError(f"response_format json_schema is not valid JSON: {e}") from e
    else:
        raise SamplingError(f"structured output kind {spec.kind!r} is not one of {KINDS}")
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise SamplingError("response_format schema is not usable: it must be a JSON object")
    return f"answer: %json {json.dumps({**schema, 'x-guidance': {'whitespace_pattern': WHITESPACE}})}"


def lark_tag(tokenizer: Tokenizer, text: str) -> str:
    """`text` in a Lark grammar: the special token `<[id]>` when the tokenizer has it as one token that
    llguidance treats as special (a special added token, or any added token that looks like `<...>`:
    Qwen's `<tool_call>`, `</think>`), which text never matches; else a string literal."""
    token = special_tokens(tokenizer).get(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


@functools.lru_cache(maxsize=8)
def special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokens llguidance treats as special, by text (its rule for a tokenizer.json's added tokens)."""
    if isinstance(tokenizer, HFTokenizer):
        added = json.loads(tokenizer.to_json()).get("added_tokens") or []
        return {t["content"]: t["id"] for t in added
                if t.get("special") or (t["content"].startswith("<") and t["content"].endswith(">"))}
    return dict(getattr(tokenizer, "special_tokens", {}))


def _lltokenizer(tokenizer: Tokenizer, vocab_size: int):
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        return LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
    assert isinstance(tokenizer, ByteTokenizer), "the engine serves a checkpoint's tokenizer or the demo's"
    return LLTokenizer(TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=eos)


class _ByteVocab:
    """The demo byte tokenizer as llguidance's TokenizerWrapper wants it: the bytes of every token id,
    special tokens marked with a leading 0xFF."""

    bos_token_id = None

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff" + name.encode() for name, _ in specials]
        self.tokens += [b""] * max(0, vocab_size - len(self.tokens))
        self.special_token_ids = [i for _, i in specials]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text) if isinstance(text, bytes) else self._tokenizer.encode(text)


def _forced_start(matcher):
    """A copy of `matcher` past the tokens its grammar forces at the start, with the mask after them computed:
    a grammar past llguidance's parser limits (a row of too many items: a schema of hundreds of optional
    properties, after its `{`) compiles and fails only at such a mask, which would fail an admitted request
    at its first token instead of refusing it. (The copy: the matcher itself stays at the start.)"""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    forced = [] if probe.is_error() else probe.compute_ff_tokens()
    if forced and probe.consume_tokens(forced):
        probe.compute_bitmask()
    return probe


def allowed_masks(grammars: list[Grammar], vocab_size: int) -> torch.Tensor:
    """Bool [len(grammars), vocab_size]: the tokens each grammar allows next. (llguidance.torch is not
    imported: its module compiles a kernel with torch.compile at import, seconds of start-up.)"""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(grammars), words), dtype=torch.int32)
    for i, g in enumerate(grammars):
        g.write_mask(bitmask[i])
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return bits.reshape(len(grammars), -1)[:, :vocab_size].bool()


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_masks_isolated(grammars: list[Grammar], vocab_size: int) -> list[torch.Tensor]:
    """`allowed_masks`, but a grammar whose mask cannot be computed allows nothing (so its request alone
    fails in sampling) instead of failing the batch."""
    try:
        return list(allowed_masks(grammars, vocab_size))
    except Exception:
        log.exception("computing the grammar masks of the batch failed; computing them one by one")
    masks = []
    for g in grammars:
        try:
            masks.append(allowed_masks([g], vocab_size)[0])
        except Exception:
            masks.append(torch.zeros(vocab_size, dtype=torch.bool))
    return masks
