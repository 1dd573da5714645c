"""Tokenizers and chat templates.

`HFTokenizer` reads a checkpoint's tokenizer.json (through the `tokenizers` library) and its chat
template (tokenizer_config.json's `chat_template` or a chat_template.jinja file). `ByteTokenizer` is
the demo model's: one token per byte plus the ChatML special tokens. Both render chat messages with
the template in a sandboxed Jinja environment, and both can say where each message starts in the
token sequence (`message_starts`), which the prefix cache uses to place snapshots.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Interface shared by the checkpoint and demo tokenizers."""

    eos_token_ids: tuple[int, ...] = ()
    special_tokens: dict[str, int] = {}

    def __init__(self, template: str | None, bos_token: str | None = None, eos_token: str | None = None):
        self._template = compile_template(template) if template else None
        self._template_vars = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text)[0]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and, for each, the character offset where it starts in `text`."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template: send a plain prompt instead")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._template_vars, **extra)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template error is the request's fault, not the server's
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], **extra) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation (with generation prompt) and, for i = 1 .. len(messages),
        the token position where the render of messages[:i] stops agreeing with the whole one: where
        messages[i] starts, and for i = len(messages) where the generation prompt starts.

        Templates that rewrite history (e.g. drop old reasoning) still give positions that a later
        request with the same history shares.
        """
        full = self.render_chat(messages, add_generation_prompt=True, **extra)
        ids, offsets = self.encode_with_offsets(full)
        starts = []
        for k in range(1, len(messages) + 1):
            prefix = self.render_chat(messages[:k], add_generation_prompt=False, **extra)
            starts.append(_token_at_or_after(offsets, _common_prefix_len(prefix, full), len(ids)))
        return ids, starts


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _token_at_or_after(offsets: list[int], char: int, num_tokens: int) -> int:
    """Index of the first token starting at or after character `char`."""
    lo, hi = 0, num_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if offsets[mid] < char:
            lo = mid + 1
        else:
            hi = mid
    return lo


class ByteTokenizer(Tokenizer):
    """The demo tokenizer: ids 0..255 are bytes, then the ChatML special tokens. Text is UTF-8."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self):
        super().__init__(CHATML_TEMPLATE, eos_token="<|im_end|>")
        self.special_tokens = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self.eos_token_ids = (self.special_tokens["<|im_end|>"], self.special_tokens["<|endoftext|>"])

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        ids, offsets = [], []
        i = 0
        while i < len(text):
            special = next((s for s in self.SPECIALS if text.startswith(s, i)), None)
            if special:
                ids.append(self.special_tokens[special])
                offsets.append(i)
                i += len(special)
                continue
            for b in text[i].encode("utf-8"):
                ids.append(b)
                offsets.append(i)
            i += 1
        return ids, offsets

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        names = {v: k for k, v in self.special_tokens.items()}
        for t in ids:
            if t < 256:
                buf.append(t)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(names.get(t, ""))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer(Tokenizer):
    """A checkpoint's tokenizer.json + tokenizer_config.json (+ chat_template.jinja when present)."""

    def __init__(self, path: str | Path, extra_eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as FastTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        self._tok = FastTokenizer.from_file(str(path / "tokenizer.json"))
        config = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = _template_source(path, config)
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        super().__init__(template, bos, eos)
        self.special_tokens = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        eos_ids = set(extra_eos_ids)
        if eos and self._tok.token_to_id(eos) is not None:
            eos_ids.add(self._tok.token_to_id(eos))
        self.eos_token_ids = tuple(sorted(eos_ids))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [start for start, _ in enc.offsets]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        """The tokenizer.json text (what grammar engines build their vocabulary from)."""
        return self._tok.to_str()


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _template_source(path: Path, config: dict) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template
