"""Per-request output: incremental detokenization, stop strings and the RequestOutput record.

Text is decoded incrementally so that a multi-byte character split across tokens is emitted only when
complete: a checkpoint's tokenizer through tokenizers' DecodeStream (about 7x faster per token than
decoding windows from Python, see benchmarks/detokenize_bench.py), the demo's byte tokenizer through
`WindowDecoder`. At the end, the ids of a character left incomplete are decoded as they are (U+FFFD).
With stop strings, the last `max(len(stop)) - 1` characters are held back from streaming
until they cannot be the start of a stop string; the final text ends before the first stop string
(or after it, with include_stop_str_in_output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cairn.sequence import CacheReport
from cairn.tokenizer import HFTokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str  # the request's id (the same for every choice of an n > 1 request)
    text: str  # everything generated so far (stop strings and end-of-sequence tokens removed)
    delta_text: str  # what this step added to `text`
    token_ids: list[int]  # generated token ids so far
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    num_prompt_tokens: int
    logprobs: list[float] = field(default_factory=list)  # per generated token, when asked for
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cache: CacheReport = field(default_factory=CacheReport)
    ttft_s: float | None = None  # arrival to first token
    error: str | None = None  # set when the request failed inside the engine
    prompt_token_ids: list[int] | None = None  # the prompt's token ids, on the finished output only
    index: int = 0  # which choice of the request this is (n > 1)
    request_finished: bool | None = None  # every choice of the request has finished (None: same as finished)

    def __post_init__(self):
        if self.request_finished is None:
            self.request_finished = self.finished


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
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop  # keep the stop string that ended the text
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded text (before stop truncation)
        self.sent = 0  # characters of text already returned as deltas
        self._step = tokenizer.decode_stream() if isinstance(tokenizer, HFTokenizer) else WindowDecoder(tokenizer)
        self._pending: list[int] = []  # ids fed since the decoder last returned text

    def add(self, token: int | None, final: bool, check_stop: bool = True) -> tuple[str, bool]:
        """Feed one token (None: no text for it, e.g. EOS). Returns (delta, hit_stop_string).
        `check_stop` False: stop strings are not looked for yet (before min_tokens)."""
        if token is not None:
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
            start = max(0, self.sent - self.hold)
            found = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if found:
                at, length = min(found)
                self.text = self.text[: at + length if self.include_stop else at]
                hit = final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta, hit
