"""Structured output: JSON grammars compiled by llguidance, one matcher per constrained request.

`GrammarCompiler` wraps the serving tokenizer once (a checkpoint's tokenizer.json, or the demo
model's byte tokenizer) and turns a StructuredOutput (response_format `json_object` or
`json_schema`) into a `Grammar`: llguidance's matcher over the token vocabulary. Each step the engine
asks every constrained request's Grammar for its mask of allowed tokens (`allowed_masks`, one bool
row per request, built from llguidance's 32-bit packed bitmask), the sampler sets the others to
-inf, and the chosen token is fed back (`accept`). When the JSON value is complete the matcher is
`done` and the request finishes with "stop"; when max_tokens cuts it first, it finishes with
"length" and the text is the unfinished JSON.

Between JSON tokens at most one space or newline is allowed (WHITESPACE, Outlines' choice), so that
a schema with bounded strings, arrays and numbers bounds the output length even for a model with
random weights, and a model cannot spend its max_tokens on indentation. No whitespace comes before
or after the value.

What this is not: the sampler (`cairn.sampling`) or the processors that apply the mask (`cairn.logits`).
"""

from __future__ import annotations

import json
import logging

import torch

from cairn.errors import SamplingError
from cairn.sampling import StructuredOutput
from cairn.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

WHITESPACE = r"[\x20\x0A]?"  # what may separate JSON tokens
ANY_OBJECT = {"type": "object"}  # response_format json_object

log = logging.getLogger(__name__)


class Grammar:
    """One request's position in its grammar. Not thread-safe; used by the engine thread only."""

    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it (the matcher is then in error)."""
        try:
            return bool(self._matcher.consume_token(token))
        except Exception:  # misuse at the API level (a token out of range): the request fails, not the batch
            return False

    @property
    def done(self) -> bool:
        """The value is complete: nothing but end-of-sequence may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def fork(self) -> Grammar:
        """An independent copy at the same position (for the other choices of an n > 1 request)."""
        return Grammar(self._matcher.deep_copy())


class GrammarCompiler:
    """Compiles StructuredOutput specs against one tokenizer and vocabulary size."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None  # llguidance.LLTokenizer, built on first use

    def compile(self, spec: StructuredOutput) -> Grammar:
        """A fresh Grammar for `spec`. Raises SamplingError (a 400) on a schema llguidance cannot use."""
        from llguidance import LLMatcher

        if spec.kind == "json_object":
            schema = ANY_OBJECT
        else:
            try:
                schema = json.loads(spec.schema or "")
            except ValueError as e:
                raise SamplingError(f"response_format json_schema is not valid JSON: {e}") from e
        options = {"whitespace_pattern": WHITESPACE}
        try:
            grammar = LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise SamplingError(f"response_format schema is not usable: {e}") from e
        matcher = LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise SamplingError(f"response_format schema is not usable: {matcher.get_error()}")
        return Grammar(matcher)

    def _lltokenizer(self):
        if self._ll is None:
            self._ll = _lltokenizer(self._tokenizer, self.vocab_size)
        return self._ll


def _lltokenizer(tokenizer: Tokenizer, vocab_size: int):
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        return LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return LLTokenizer(TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=eos)
    raise SamplingError(f"structured output is not available with a {type(tokenizer).__name__}")


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


def allowed_masks(grammars: list[Grammar], vocab_size: int) -> torch.Tensor:
    """Bool [len(grammars), vocab_size]: the tokens each grammar allows next. (llguidance.torch is not
    imported: its module compiles a kernel with torch.compile at import, seconds of start-up.)"""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(grammars), words), dtype=torch.int32)
    for i, g in enumerate(grammars):
        row = bitmask[i]
        g._matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
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
