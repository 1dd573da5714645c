"""The demo corpus: a seeded stream of documents mixing generated conversations with the machine's own text.

`documents(seed, part)` yields texts, each ending with `<|endoftext|>`: a generated dialogue
(cairn.demo.dialogues, rendered in the demo template) 80% of the time, else a window of up to
`WINDOW_CHARS` characters (cut at line ends) of a standard-library source (10%) or of an English
licence or documentation text (10%). `part="train"` draws from the training part of every source list,
`part="held_out"` from the rest (cairn.demo.sources.held_out), with its own seed, for the evaluation.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from functools import cache

from cairn.demo import dialogues, sources

END = "<|endoftext|>"
WINDOW_CHARS = 4000
MIX = (("dialogue", 80), ("python", 10), ("english", 10))


@cache
def material(part: str) -> dict:
    """Each source list, restricted to `part` ("train" or "held_out")."""
    keep = (lambda name: sources.held_out(name)) if part == "held_out" else (lambda name: not sources.held_out(name))
    return {
        "python": [text for name, text in sources.stdlib_sources() if keep(name)],
        "english": [text for name, text in sources.english_texts() if keep(name)],
        "docs": [d for d in sources.api_docs() if keep(f"{d.module}.{d.name}")],
        "snippets": [s for s in sources.code_snippets() if keep(s.name)],
    }


def window(rng: random.Random, text: str) -> str:
    """Up to WINDOW_CHARS characters of `text`, from a line start to a line end."""
    if len(text) <= WINDOW_CHARS:
        return text
    start = rng.randrange(len(text) - WINDOW_CHARS)
    start = text.find("\n", start) + 1
    piece = text[start:start + WINDOW_CHARS]
    return piece[:piece.rfind("\n") + 1] or piece


def world(seed: int, part: str) -> dialogues.World:
    m = material(part)
    return dialogues.World(random.Random(seed), m["docs"], m["snippets"])


def documents(seed: int, part: str = "train") -> Iterator[str]:
    """The endless document stream of `part`, the same for the same seed on the same machine."""
    m = material(part)
    rng = random.Random(seed * 2 + 1)
    w = world(seed, part)
    kinds, weights = zip(*MIX, strict=True)
    while True:
        kind = rng.choices(kinds, weights)[0]
        if kind == "dialogue":
            yield dialogues.render(dialogues.dialogue(w)) + END
        else:
            yield window(rng, rng.choice(m[kind])) + END
