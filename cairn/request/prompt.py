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

from dataclasses import dataclass, field
from typing import Any

from cairn.errors import PromptTooLong
from cairn.request.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenizedPrompt:
    token_ids: list[int]  # the engine takes this list over (it appends the generated tokens to it)
    message_starts: list[int] = field(default_factory=list)  # sorted positions in (0, len) where a message
    #   or the generation prompt starts (empty for a plain prompt)
    user_message_starts: list[int] = field(default_factory=list)  # the positions that start a user message


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
    if kwargs.pop("continue_final_message", False):  # the answer continues the last message's content
        text, char_starts = tokenizer.render_chat_continuing(messages, **kwargs)
    else:
        text, char_starts = tokenizer.render_chat_with_starts(messages, **kwargs)
    text += generation_prefix
    _refuse_if_surely_too_long(tokenizer, text, max_model_len)
    ids, starts = tokenizer.encode_rendered(text, char_starts)
    # starts[k - 1] is where messages[k] starts (and the last one where the generation prompt starts)
    user_starts = [p for p, m in zip(starts, messages[1:], strict=False) if m.get("role") == "user"]
    return TokenizedPrompt(ids, sorted({p for p in starts if 0 < p < len(ids)}), user_starts)


def _refuse_if_surely_too_long(tokenizer: Tokenizer, text: str, max_model_len: int | None) -> None:
    """Encoding megabytes that cannot fit costs seconds and gigabytes of token and offset lists:
    refuse a text with more characters than max_model_len tokens can cover."""
    per_token = tokenizer.max_chars_per_token
    if max_model_len is not None and per_token is not None and len(text) > max_model_len * per_token:
        raise PromptTooLong(f"prompt has more than {len(text) // per_token} tokens ({len(text)} characters); "
                              f"this model's context is {max_model_len} tokens")
