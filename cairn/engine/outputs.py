"""Per-request output: incremental detokenization, stop strings, the per-step RequestOutput record
and the Completion its consumers accumulate.

Text is decoded incrementally so that a multi-byte character split across tokens is emitted only when
complete: a checkpoint's tokenizer through tokenizers' DecodeStream (about 7x faster per token than
decoding windows from Python, see benchmarks/detokenize_bench.py), the demo's byte tokenizer through
`WindowDecoder`. At the end, the ids of a character left incomplete are decoded as they are (U+FFFD).
With stop strings, the last `max(len(stop)) - 1` characters are held back from streaming
until they cannot be the start of a stop string; the final text ends before the first stop string
(or after it, with include_stop_str_in_output). A stop string is looked for only in text not yet
returned, so the deltas always add up to the final text (a stop string completed while min_tokens
still held the check back, and partly streamed since, does not cut text already sent).
The text of the tokens in `hidden` (special tokens, with skip_special_tokens) is left out: they are not
fed to the decoder at all, so stop strings are looked for in the text the user gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cairn.cache.base import CacheReport
from cairn.request.tokenizer import HFTokenizer, Tokenizer


@dataclass
class RequestOutput:
    """What one engine step added to one choice of a request: this step's tokens, text and logprobs only,
    so an output's size does not grow with the length of the answer. Consumers that need the whole answer
    accumulate the outputs of each choice in order (`Completion.add`)."""

    request_id: str  # the request's id (the same for every choice of an n > 1 request)
    delta_text: str  # text this step added (stop strings and end-of-sequence tokens removed)
    delta_token_ids: list[int]  # token ids this step generated (one, or none for an abort or an error)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    num_prompt_tokens: int
    request_finished: bool  # every choice of the request has finished (with n = 1: finished)
    delta_logprobs: list[float] = field(default_factory=list)  # per token of delta_token_ids, when asked for
    delta_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cache: CacheReport = field(default_factory=CacheReport)
    ttft_s: float | None = None  # arrival to first token
    error: str | None = None  # set when the request failed inside the engine
    prompt_token_ids: list[int] | None = None  # the prompt's token ids, on the finished output only
    index: int = 0  # which choice of the request this is (n > 1)


@dataclass
class Completion:
    """One choice's whole answer so far, accumulated from its RequestOutputs in order (`add`)."""

    request_id: str
    index: int = 0
    token_ids: list[int] = field(default_factory=list)  # generated token ids
    logprobs: list[float] = field(default_factory=list)  # per generated token, when asked for
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    cache: CacheReport = field(default_factory=CacheReport)
    ttft_s: float | None = None
    error: str | None = None
    prompt_token_ids: list[int] | None = None
    _pieces: list[str] = field(default_factory=list, repr=False)  # the deltas' text, joined on reading

    @property
    def text(self) -> str:
        """Everything generated so far (stop strings and end-of-sequence tokens removed)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, out: RequestOutput) -> Completion:
        """Fold in the next output of this choice; returns self."""
        if out.delta_text:
            self._pieces.append(out.delta_text)
        self.token_ids += out.delta_token_ids
        self.logprobs += out.delta_logprobs
        self.top_logprobs += out.delta_top_logprobs
        self.finished, self.finish_reason, self.cache = out.finished, out.finish_reason, out.cache
        self.num_prompt_tokens, self.ttft_s = out.num_prompt_tokens, out.ttft_s
        self.error = out.error or self.error
        if out.prompt_token_ids is not None:
            self.prompt_token_ids = out.prompt_token_ids
        return self


def accumulate(completions: dict[tuple[str, int], Completion], out: RequestOutput) -> Completion:
    """Add `out` to its choice's Completion in `completions` (keyed by (request id, index)); returns it."""
    key = (out.request_id, out.index)
    if key not in completions:
        completions[key] = Completion(out.request_id, out.index)
    return completions[key].add(out)


class WindowDecoder:
    """Incremental decoding for any tokenizer: decode a short window of recent ids twice (without and
    with the new ones) and return the difference, once it does not end in an incomplete character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix, self._read = 0, 0

    def __call__(self, token: int) -> str | None:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return None


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], include_stop: bool = False,
                 hidden: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.hidden = hidden  # token ids whose text is left out (special tokens, with skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop  # keep the stop string that ended the text
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded text (before stop truncation)
        self.sent = 0  # characters of text already returned as deltas
        self._step = tokenizer.decode_stream() if isinstance(tokenizer, HFTokenizer) else WindowDecoder(tokenizer)
        self._pending: list[int] = []  # ids fed since the decoder last returned text

    def add(self, token: int | None, final: bool, check_stop: bool = True) -> tuple[str, bool]:
        """Feed one token (None, or a token in `hidden`: no text for it, e.g. EOS). Returns (delta,
        hit_stop_string). `check_stop` False: stop strings are not looked for yet (before min_tokens)."""
        if token is not None and token not in self.hidden:
            self._pending.append(token)
            piece = self._step(token)
            if piece is not None:
                self.text += piece
                self._pending.clear()
        if final and self._pending:  # an incomplete character at the very end: its replacement characters
            self.text += self.tokenizer.decode(self._pending)
            self._pending.clear()
        hit = False
        if self.stop and check_stop:
            start = self.sent  # a stop string ending in the new text starts after what was sent (held back)
            found = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if found:
                at, length = min(found)
                self.text = self.text[: at + length if self.include_stop else at]
                hit = final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta, hit

    def flush(self) -> str:
        """The text not yet returned (held back for stop strings): the last delta of an answer that ends
        without a final token (aborted, or failed)."""
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta
