"""Deterministic filler text sized in tokens, for the benchmark's synthetic conversations.

What it is: `TextSource(seed, tokenizer)` draws ASCII words (and the odd number or identifier, so
texts look like code-agent traffic) from its own `random.Random(seed)`; `words(num_tokens)` returns
text of about `num_tokens` tokens under `tokenizer` (exact for byte-level tokenizers, within a few
percent otherwise). The same seed and the same sequence of calls give the same texts.

What it is not: meaningful text. The benchmark's models have random weights; what matters to the
cache is only where prompts agree and where they diverge.
"""

from __future__ import annotations

import random

from cairn.request.tokenizer import Tokenizer

WORDS = (
    "the", "a", "of", "to", "and", "in", "is", "for", "on", "with", "that", "this", "it", "as", "be", "by", "are",
    "from", "at", "or", "an", "was", "not", "file", "line", "test", "function", "return", "value", "error", "build",
    "run", "cache", "state", "token", "prompt", "model", "layer", "request", "server", "client", "path", "node",
    "page", "slot", "tier", "disk", "host", "device", "snapshot", "position", "chunk", "prefix", "branch", "merge",
    "commit", "diff", "patch", "fix", "check", "assert", "import", "module", "class", "method", "field", "config",
    "option", "flag", "default", "output", "input", "read", "write", "open", "close", "list", "dict", "set", "map",
    "key", "index", "count", "size", "length", "offset", "range", "start", "end", "next", "first", "last", "new",
    "old", "result", "status", "update", "change", "remove", "add", "create", "delete", "move", "copy", "load",
    "save", "parse",
)
CALIBRATION_CHARS = 4096


class TextSource:
    def __init__(self, seed: int, tokenizer: Tokenizer):
        self.rng = random.Random(seed)
        self.tokenizer = tokenizer
        sample = " ".join(random.Random(seed ^ 0x5EED).choice(WORDS) for _ in range(CALIBRATION_CHARS // 5))
        self.chars_per_token = len(sample) / max(1, len(tokenizer.encode(sample)))

    def _word(self) -> str:
        roll = self.rng.random()
        if roll < 0.05:
            return str(self.rng.randrange(10_000))
        if roll < 0.10:
            return f"{self.rng.choice(WORDS)}_{self.rng.choice(WORDS)}"
        return self.rng.choice(WORDS)

    def words(self, num_tokens: int) -> str:
        """Text of about `num_tokens` tokens (at least one word)."""
        target_chars = max(1, round(num_tokens * self.chars_per_token))
        parts, num_chars = [], 0
        while num_chars < target_chars:
            word = self._word()
            parts.append(word)
            num_chars += len(word) + 1
        return " ".join(parts)[:target_chars].rstrip() or parts[0]

    def jittered(self, mean_tokens: int) -> int:
        """A length drawn uniformly from [mean / 2, 3 * mean / 2]."""
        return self.rng.randint(max(1, mean_tokens // 2), max(1, mean_tokens * 3 // 2))
