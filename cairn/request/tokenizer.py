"""Tokenizers and chat templates.

`HFTokenizer` reads a checkpoint's tokenizer.json (through the `tokenizers` library) and its chat
template (tokenizer_config.json's `chat_template` or a chat_template.jinja file). `ByteTokenizer` is
the demo model's: one token per byte plus the ChatML special tokens. Both render chat messages with
the template in a sandboxed Jinja environment, and both can say where each message starts in the
token sequence (`message_starts`), which the prefix cache uses to place snapshots.

Message starts cost one render: the template's loop over `messages` is instrumented (in its Jinja
syntax tree) to print a marker variable at the start of each iteration and after the loop; a plain
render leaves the variable undefined, which prints nothing. Everything here is safe to call from
any thread (the server tokenizes off the engine thread), and encoding is linear in the text.
"""

from __future__ import annotations

import abc
import itertools
import json
import logging
import operator
import re
import secrets
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cairn.errors import ChatTemplateError

log = logging.getLogger("cairn.tokenizer")  # the name of its log lines, not the module path
MARK_VAR = "cairn_message_mark"  # printed where each message's render starts (see encode_chat)
MAX_PREFIX_RENDERS = 16  # a template with no loop over `messages`: renders of prefixes to find message starts
TEMPLATE_VARIABLES_SET_HERE = ("messages", "add_generation_prompt", "bos_token", "eos_token", MARK_VAR,
                               "raise_exception", "strftime_now")  # a caller's extra variables must not set them

# The demo model's template: ChatML (plain conversations render as plain ChatML) that also
# renders tools, assistant reasoning and tool calls the way Qwen3.5's template does (XML-style calls),
# and opens (`enable_thinking: true`) or closes (`false`) the reasoning when asked.
DEMO_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nTo call a function reply:\n<tool_call>\n<function=NAME>\n<parameter=NAME>\nVALUE\n"
    "</parameter>\n</function>\n</tool_call>' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- '\n\n' + messages[0]['content'] }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if message.get('reasoning_content') %}"
    "{{- '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' }}"
    "{%- endif %}"
    "{{- message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- ('\n' if message['content'] or not loop.first else '') + '<tool_call>\n<function='"
    " + call['function']['name'] + '>\n' }}"
    "{%- for name, value in call['function']['arguments'].items() %}"
    "{{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}"
    "{%- endfor %}"
    "{{- '</function>\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined %}{{- '<think>\n' if enable_thinking else '<think>\n\n</think>\n\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    ast = env.parse(source)
    _mark_messages_loop(ast)
    return env.from_string(ast)


def _mark_messages_loop(ast: nodes.Template) -> bool:
    """Print MARK_VAR at the start of each iteration of the first output-level `for ... in messages`
    loop and right after it. Returns False (template unchanged) when there is no such loop."""
    found = _find_messages_loop(ast.body)
    if found is None:
        return False
    parent, i = found
    loop = parent[i]
    parent.insert(i + 1, nodes.Output([nodes.Name(MARK_VAR, "load", lineno=loop.lineno)], lineno=loop.lineno))
    loop.body.insert(0, nodes.Output([nodes.Name(MARK_VAR, "load", lineno=loop.lineno)], lineno=loop.lineno))
    return True


def _find_messages_loop(body: list[nodes.Node]) -> tuple[list[nodes.Node], int] | None:
    """(list holding the loop, its index), searching only statements whose output is the template's
    own (not macros, call or filter blocks, or `{% set %}` blocks, which capture their output)."""
    for i, node in enumerate(body):
        if isinstance(node, nodes.For) and isinstance(node.iter, nodes.Name) and node.iter.name == "messages":
            return body, i
        children: list[list[nodes.Node]] = []
        if isinstance(node, nodes.If):
            children = [node.body, *(e.body for e in node.elif_), node.else_]
        elif isinstance(node, (nodes.For, nodes.Scope, nodes.With, nodes.ScopedEvalContextModifier)):
            children = [node.body, *([node.else_] if isinstance(node, nodes.For) else [])]
        for child in children:
            found = _find_messages_loop(child)
            if found is not None:
                return found
    return None


class Tokenizer(abc.ABC):
    """Interface shared by the checkpoint and demo tokenizers."""

    eos_token_ids: tuple[int, ...] = ()
    special_tokens: dict[str, int] = {}
    max_chars_per_token: int | None = None  # no token covers more characters of input text (None: unknown)

    def __init__(self, template: str | None, bos_token: str | None = None, eos_token: str | None = None):
        self._template = compile_template(template) if template else None
        self.template_source = template or ""  # the chat template's text (parsers read its call format)
        self._template_vars = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text)[0]

    @abc.abstractmethod
    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and, for each, the character offset where it starts in `text`."""

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (special tokens included)."""

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token adds to the text (a special token: its text's), even when they are not
        whole characters: a byte-level token may hold part of one, which decode([token_id]) gives as U+FFFD."""

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

    def encode_chat(self, messages: list[dict[str, Any]], generation_prefix: str = "",
                    **extra) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation (with generation prompt) and, for i = 1 .. len(messages),
        where messages[i] starts in them (for i = len(messages): where the generation prompt starts):
        the token holding the character render_chat_with_starts gives. `extra` (tools,
        chat_template_kwargs such as enable_thinking) goes to the template; `generation_prefix` is
        appended after the generation prompt (text forced as the answer's start)."""
        text, char_starts = self.render_chat_with_starts(messages, **extra)
        return self.encode_rendered(text + generation_prefix, char_starts)

    def encode_rendered(self, text: str, char_starts: list[int]) -> tuple[list[int], list[int]]:
        """Token ids of `text` and, for each character position, the token holding it (tokens before it
        hold only characters before it; len(ids) for the end of the text)."""
        ids, offsets = self.encode_with_offsets(text)
        return ids, [len(ids) if c >= len(text) else _token_holding(offsets, c, len(ids)) for c in char_starts]

    def render_chat_with_starts(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                **extra) -> tuple[str, list[int]]:
        """The rendered conversation (with generation prompt, unless told not to) and, for i = 1 .. len(messages),
        the character where the template starts rendering messages[i] (for i = len(messages): where its
        loop over the messages ends, i.e. where the generation prompt starts). One render, whatever
        the number of messages.

        Where the render of messages[:i] is a prefix of the whole one (ChatML and most templates) this
        is where it ends. Templates that render a message differently when it is the last one give the
        start in the whole render, which a later request extending the conversation shares.
        """
        marker = f"\x00{secrets.token_hex(8)}\x00"  # unguessable: no message can forge one
        parts = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra,
                                 **{MARK_VAR: marker}).split(marker)
        if len(parts) != len(messages) + 2:  # no loop over `messages` found, or it skipped some
            return self._render_chat_by_prefix_renders(messages, add_generation_prompt, **extra)
        marks = list(itertools.accumulate(len(p) for p in parts))  # marks[i]: where message i starts
        return "".join(parts), marks[1:len(messages) + 1]

    def render_chat_continuing(self, messages: list[dict[str, Any]], **extra) -> tuple[str, list[int]]:
        """render_chat_with_starts for an answer that continues the last message (transformers' and vLLM's
        continue_final_message, Anthropic's prefilled assistant turn): the conversation rendered without a
        generation prompt and cut where the last message's content ends, so that the template puts around
        that message what it puts around any (Qwen3's empty `<think>` block) and nothing after it. Raises
        ChatTemplateError when the template does not render that content as sent."""
        tag = f"\x00{secrets.token_hex(8)}\x00"  # unguessable: no message can forge one
        last = {**messages[-1], "content": (messages[-1].get("content") or "") + tag + " "}
        text, starts = self.render_chat_with_starts([*messages[:-1], last], add_generation_prompt=False, **extra)
        if text.count(tag) != 1:
            raise ChatTemplateError("the chat template does not render the last message's content as it was sent, "
                                    "so the answer cannot continue it")
        end = text.index(tag)
        kept = text[:end] if text.startswith(tag + " ", end) else text[:end].rstrip()  # a template that trims
        #   the content (Qwen3.5's) trims its trailing whitespace, as transformers does
        return kept, [min(start, len(kept)) for start in starts]

    def _render_chat_by_prefix_renders(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                       **extra) -> tuple[str, list[int]]:
        """render_chat_with_starts for templates the marker cannot instrument: where the render of
        messages[:i] stops agreeing with the whole one, one render per message, for the last
        MAX_PREFIX_RENDERS only (the starts a conversation's next turn resumes from); the earlier ones are 0
        (no start: no snapshot is placed there). One render per message of all of them was quadratic: a
        request of 8,000 empty messages, a 256 KiB body, took minutes of the server's CPU."""
        log.debug("chat template has no loop over `messages`: rendering prefixes for the message starts")
        full = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        first = max(1, len(messages) - MAX_PREFIX_RENDERS + 1)
        starts: list[int] = [0] * (first - 1)
        for k in range(first, len(messages) + 1):
            try:
                prefix = self.render_chat(messages[:k], add_generation_prompt=False, **extra)
            except ChatTemplateError:  # the template refuses this prefix (e.g. no user message yet)
                starts.append(starts[-1] if starts else 0)
                continue
            starts.append(common_prefix_len(prefix, full))
        return full, starts


def common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix, by bisection over slice comparisons (which run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _token_holding(offsets: list[int], char: int, num_tokens: int) -> int:
    """Index of the token that holds character `char` (the first one starting at or after it when it
    starts a token): tokens before it hold only characters before `char`."""
    i = _token_at_or_after(offsets, char, num_tokens)
    if i > 0 and (i == num_tokens or offsets[i] > char) and offsets[i - 1] < char:
        return i - 1
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


_SPECIAL_RE = re.compile("<\\|(?:endoftext|im_start|im_end)\\|>")
_BYTE_PIECE = re.compile("<0x([0-9A-Fa-f]{2})>")  # a byte-fallback vocabulary's piece for one byte
_CHAR_START = bytes(0 if 0x80 <= b < 0xC0 else 1 for b in range(256))  # 0 for UTF-8 continuation bytes
ENCODE_CHUNK_CHARS = 1 << 16  # bytes are encoded this many characters at a time, so no call holds the GIL long


def _encode_bytes(text: str, start: int, end: int, ids: list[int], offsets: list[int]) -> None:
    """Append the UTF-8 bytes of text[start:end] to ids and, for each, the index of its character."""
    for lo in range(start, end, ENCODE_CHUNK_CHARS):
        data = text[lo:min(end, lo + ENCODE_CHUNK_CHARS)].encode("utf-8")
        ids.extend(data)
        # character index of byte j = lo - 1 + (number of character-start bytes in data[:j + 1])
        offsets.extend(map(operator.add, itertools.accumulate(data.translate(_CHAR_START)), itertools.repeat(lo - 1)))


class ByteTokenizer(Tokenizer):
    """The demo tokenizer: ids 0..255 are bytes, then the ChatML special tokens. Text is UTF-8."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __reduce__(self):  # (pickled into the server's tokenizer worker processes)
        return ByteTokenizer, ()

    def __init__(self):
        super().__init__(DEMO_CHAT_TEMPLATE, eos_token="<|im_end|>")
        self.special_tokens = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self.max_chars_per_token = max(len(t) for t in self.SPECIALS)
        self.eos_token_ids = (self.special_tokens["<|im_end|>"], self.special_tokens["<|endoftext|>"])

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        offsets: list[int] = []
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            _encode_bytes(text, pos, m.start(), ids, offsets)
            ids.append(self.special_tokens[m.group()])
            offsets.append(m.start())
            pos = m.end()
        _encode_bytes(text, pos, len(text), ids, offsets)
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

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else self.decode([token_id]).encode("utf-8")


class HFTokenizer(Tokenizer):
    """A checkpoint's tokenizer.json + tokenizer_config.json (+ chat_template.jinja when present)."""

    def __init__(self, path: str | Path, extra_eos_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as FastTokenizer

        self._init_args = (path, extra_eos_ids)
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
        self.max_chars_per_token = _max_chars_per_token(self._tok)
        self._added_ids = frozenset(self._tok.get_added_tokens_decoder())  # their pieces are their text
        decoders = _decoder_types(self._tok.decoder)
        self._byte_level = "ByteLevel" in decoders  # pieces spell each byte as one character (BYTE_OF_CHAR)
        self._byte_fallback = "ByteFallback" in decoders  # pieces <0xNN> stand for one byte

    def __reduce__(self):  # (pickled into the server's tokenizer worker processes)
        return HFTokenizer, self._init_args

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        # encode_batch releases the GIL while it works (encode does not): other threads keep running
        enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        return list(enc.ids), [start for start, _ in enc.offsets]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """A byte-level piece mapped back to its bytes, a byte-fallback piece's byte; else (an added token,
        a whole-character piece) the token's decoded text."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id not in self._added_ids:
            if self._byte_level and all(c in BYTE_OF_CHAR for c in piece):
                return bytes(BYTE_OF_CHAR[c] for c in piece)
            if self._byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
                return bytes([int(m.group(1), 16)])
        return self.decode([token_id]).encode("utf-8")

    def decode_stream(self) -> Callable[[int], str | None]:
        """tokenizers' incremental decoder (DecodeStream) on this tokenizer: feed one id, get the new text,
        or None while the id does not complete a character. Used by cairn.engine.outputs.Detokenizer."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=False)
        return lambda token: stream.step(self._tok, token)


    def to_json(self) -> str:
        """The tokenizer.json text (what grammar engines build their vocabulary from)."""
        return self._tok.to_str()


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, which byte-level BPE vocabularies are written in: each byte as one
    printable character (printable Latin-1 bytes as themselves, the others as U+0100 onwards), char -> byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = (b for b in range(256) if b not in printable)
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


BYTE_OF_CHAR = _byte_of_char()


def _decoder_types(decoder) -> set[str]:
    """The types of a tokenizers decoder and of those a Sequence holds ("ByteLevel", "ByteFallback", ...)."""
    if decoder is None:
        return set()
    found: set[str] = set()
    stack = [json.loads(decoder.__getstate__())]
    while stack:
        node = stack.pop()
        found.add(node.get("type", ""))
        stack += node.get("decoders") or []
    return found


UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})  # these merge at most ~3 characters into one


def _max_chars_per_token(tok) -> int | None:
    """A bound on the input characters one token covers: its longest vocabulary string (a byte-level
    BPE spells each byte as one character), times 4 for what Unicode normalization may merge. None
    when another normalizer (which might delete text) runs first."""
    normalizer = tok.normalizer
    if normalizer is not None and type(normalizer).__name__ not in UNICODE_NORMALIZERS:
        return None
    longest = max(len(t) for t in tok.get_vocab(with_added_tokens=True))
    return 4 * longest if normalizer is not None else longest


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
