"""TokenizedPrompt: a request's prompt as the engine takes it, and `tokenize_prompt`, the work that
makes one.

A prompt reaches the engine as token ids plus, for a chat, the token positions where messages start
(the prefix cache places snapshots there). Making them (rendering the chat template, encoding the
text) is the heavy part of accepting a request, and it touches only the tokenizer, so it may run on
any thread: the server runs it in a worker thread and hands the engine thread the result, while the
offline API (`Engine.add_request(messages=...)`) calls it inline. What this is not: the checks
against the model (vocabulary, context length), which `Engine.add_request` makes.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from cairn.errors import PromptTooLong
from cairn.request.tokenizer import Tokenizer, common_prefix_len

log = logging.getLogger("cairn.tokenizer")
CACHE_MARKS = "cache_marks"  # the template_kwargs key of a chat's CacheMarks (popped before the template runs)


@dataclass(frozen=True)
class CacheMark:
    """A client's cache breakpoint before the render (Anthropic's `cache_control`): the end of a marked block,
    said in the chat messages the template renders: the marked text ends at character `content_end` of
    messages[`message`]["content"], or the marked block is the tool call messages[`message`]["tool_calls"][`call`],
    or the tool `tools[tool]` of the template's tools."""

    ttl_s: int  # how long the client asks the prefix to be kept (the cache pins its snapshot: cache/policy/pins.py)
    where: str  # the marked field as the client sent it ("system.1", "messages.0.content.1", "tools.3"), for the log
    message: int | None = None
    content_end: int = 0
    call: int | None = None
    tool: int | None = None


@dataclass(frozen=True)
class Breakpoint:
    """A cache breakpoint located in the prompt: the cache places a snapshot (source `breakpoint`) at `position`,
    the last token boundary at or before the end of the marked block in the render (the end itself whenever a
    token ends there: always with byte tokens, and before a special token)."""

    position: int
    ttl_s: int


@dataclass(frozen=True)
class TokenizedPrompt:
    token_ids: list[int]  # the engine takes this list over (it appends the generated tokens to it)
    message_starts: list[int] = field(default_factory=list)  # sorted positions in (0, len) where a message
    #   or the generation prompt starts (empty for a plain prompt)
    user_message_starts: list[int] = field(default_factory=list)  # the positions that start a user message
    breakpoints: list[Breakpoint] = field(default_factory=list)  # the located cache marks, sorted by position


def tokenize_prompt(tokenizer: Tokenizer, prompt: str | list[int] | None = None,
                    messages: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                    max_model_len: int | None = None, message_starts: list[int] | None = None) -> TokenizedPrompt:
    """A text prompt, token ids, or chat messages (rendered with the template, `template_kwargs` passed
    to it; its `generation_prefix`, if any, is appended to the render; with `continue_final_message` the render
    ends inside the last message, which the answer continues) as a TokenizedPrompt; token ids
    keep the `message_starts` given with them. Raises ChatTemplateError for messages the template refuses, and,
    given `max_model_len`, PromptTooLong without encoding a text too long to fit in any case.
    Imports no torch: it also runs in the server's tokenizer worker processes."""
    if messages is None:
        if isinstance(prompt, str):
            _refuse_if_surely_too_long(tokenizer, prompt, max_model_len)
            return TokenizedPrompt(tokenizer.encode(prompt))
        ids = list(prompt or [])
        return TokenizedPrompt(ids, sorted({p for p in message_starts or () if 0 < p < len(ids)}))
    kwargs = dict(template_kwargs or {})
    generation_prefix = kwargs.pop("generation_prefix", "")  # forced start of the answer (a tool call's)
    marks: list[CacheMark] = kwargs.pop(CACHE_MARKS, None) or []
    continuing = kwargs.pop("continue_final_message", False)  # the answer continues the last message's content
    render = tokenizer.render_chat_continuing if continuing else tokenizer.render_chat_with_starts
    text, char_starts = render(messages, **kwargs)
    mark_ends = _mark_ends(render, messages, kwargs, text, marks) if marks else {}
    text += generation_prefix
    _refuse_if_surely_too_long(tokenizer, text, max_model_len)
    located = list(mark_ends.items())
    ids, positions = tokenizer.encode_rendered(text, char_starts + [end for _, end in located])
    starts, mark_positions = positions[:len(char_starts)], positions[len(char_starts):]
    # starts[k - 1] is where messages[k] starts (and the last one where the generation prompt starts)
    user_starts = [p for p, m in zip(starts, messages[1:], strict=False) if m.get("role") == "user"]
    breakpoints = sorted((Breakpoint(p, mark.ttl_s) for (mark, _), p in zip(located, mark_positions, strict=True)
                          if 0 < p <= len(ids)), key=lambda b: b.position)
    return TokenizedPrompt(ids, sorted({p for p in starts if 0 < p < len(ids)}), user_starts, breakpoints)


def _mark_ends(render, messages: list[dict[str, Any]], kwargs: dict[str, Any], text: str,
               marks: list[CacheMark]) -> dict[CacheMark, int]:
    """The character of the render `text` where each mark's block ends, for the marks that can be located; each
    one that cannot is left out (no snapshot for it, a debug log line), never given a guessed place.

    A marked text: the messages rendered again with a unique sentinel right after the marked text; that render,
    less its sentinels, must be `text` exactly (else the sentinels changed what the template rendered, and no text
    mark is located), each sentinel must appear once, and the render must show the message's content up to the
    mark right before it. A marked tool call: see `_call_mark_end`. A marked tool: where its JSON (as the
    template's `tojson` writes it) ends, when the render holds that JSON exactly once (a template that renders
    tools otherwise locates none)."""
    ends: dict[CacheMark, int] = {}
    texts = [m for m in marks if m.message is not None and m.call is None]
    if texts:
        ends.update(_text_mark_ends(render, messages, kwargs, text, texts))
    for mark in marks:
        if mark.call is not None:
            end = _call_mark_end(render, messages, kwargs, text, mark)
            if end is not None:
                ends[mark] = end
    for mark in marks:
        if mark.tool is None:
            continue
        tools = kwargs.get("tools") or []
        spelled = json.dumps(tools[mark.tool], ensure_ascii=False) if mark.tool < len(tools) else None
        if spelled is not None and text.count(spelled) == 1:
            ends[mark] = text.index(spelled) + len(spelled)
    for mark in marks:
        if mark not in ends:
            log.debug("cache_control on %s: its end was not found in the rendered prompt; no snapshot for it",
                      mark.where)
    return ends


def _call_mark_end(render, messages: list[dict[str, Any]], kwargs: dict[str, Any], text: str,
                   mark: CacheMark) -> int | None:
    """Where the render `text` of `messages` ends the tool call `mark.call` of message `mark.message`, or None.

    The messages are rendered twice more, that message holding the calls up to the marked one: once as it is,
    once with a sentinel call after it; the two agree exactly up to the end of the marked call (and any text the
    template writes both after a last call and between two calls), where that message ends in one and the
    sentinel call starts in the other. That point must be in `text` too (a prefix of it), past the call's name."""
    i, k = mark.message, mark.call
    calls = messages[i].get("tool_calls") if i < len(messages) else None
    if not calls or not 0 <= k < len(calls):
        return None
    sentinel = {"id": f"call_{secrets.token_hex(8)}", "type": "function",
                "function": {"name": f"x{secrets.token_hex(8)}", "arguments": {}}}

    def rendered(with_calls: list[dict[str, Any]]) -> str:
        changed = [dict(m) for m in messages]
        changed[i]["tool_calls"] = with_calls
        return render(changed, **kwargs)[0]

    try:
        upto, past = rendered(calls[:k + 1]), rendered(calls[:k + 1] + [sentinel])
    except Exception:  # the template refuses what it accepted without the change: not located
        return None
    end = common_prefix_len(upto, past)
    name = calls[k].get("function", {}).get("name", "")
    if sentinel["function"]["name"] not in past[end:] or not text.startswith(upto[:end]) or name not in text[:end]:
        return None
    return end


def _text_mark_ends(render, messages: list[dict[str, Any]], kwargs: dict[str, Any], text: str,
                    marks: list[CacheMark]) -> dict[CacheMark, int]:
    """_mark_ends of the marks on message contents (see there)."""
    tag = secrets.token_hex(8)
    sentinels = {mark: f"\x00{tag}:{k}\x00" for k, mark in enumerate(marks)}
    marked = [dict(m) for m in messages]
    by_message: dict[int, list[CacheMark]] = {}
    for mark in marks:
        content = messages[mark.message].get("content") if mark.message < len(messages) else None
        if isinstance(content, str) and 0 <= mark.content_end <= len(content):
            by_message.setdefault(mark.message, []).append(mark)
    for i, on_it in by_message.items():
        content = messages[i]["content"]
        pieces, cut = [], 0
        for mark in sorted(on_it, key=lambda m: m.content_end):
            pieces += [content[cut:mark.content_end], sentinels[mark]]
            cut = mark.content_end
        marked[i]["content"] = "".join(pieces) + content[cut:]
    try:
        with_sentinels = render(marked, **kwargs)[0]
    except Exception:  # the template refuses what it accepted without the sentinels: locate none
        return {}
    ends: dict[CacheMark, int] = {}
    clean, cut, removed = [], 0, 0
    found = sorted((with_sentinels.find(s), mark) for mark, s in sentinels.items() if with_sentinels.count(s) == 1
                   and mark.message in by_message)
    for at, mark in found:
        clean.append(with_sentinels[cut:at])
        ends[mark] = at - removed
        cut, removed = at + len(sentinels[mark]), removed + len(sentinels[mark])
    clean.append(with_sentinels[cut:])
    if "".join(clean) != text:  # the sentinels changed the render (or one of them is not in it once)
        return {}
    return {mark: end for mark, end in ends.items()
            if text[:end].endswith(messages[mark.message]["content"][:mark.content_end].lstrip())}


def _refuse_if_surely_too_long(tokenizer: Tokenizer, text: str, max_model_len: int | None) -> None:
    """Encoding megabytes that cannot fit costs seconds and gigabytes of token and offset lists:
    refuse a text with more characters than max_model_len tokens can cover."""
    per_token = tokenizer.max_chars_per_token
    if max_model_len is not None and per_token is not None and len(text) > max_model_len * per_token:
        raise PromptTooLong(f"prompt has more than {len(text) // per_token} tokens ({len(text)} characters); "
                              f"this model's context is {max_model_len} tokens")
