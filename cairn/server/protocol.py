"""Request bodies of the OpenAI API as pydantic models, and their conversion to engine inputs.

Only the fields cairn honours are declared; unknown fields are ignored (clients send many). Fields
that would change the output in a way cairn cannot do (n > 1, echo, penalties, a batch of prompts,
non-text content) are refused with a 400 rather than silently ignored. Range checks of the sampling
fields are SamplingParams' own (its SamplingError becomes a 400), so there is one source of truth.

What this module is not: response shapes (see `responses`) or anything that touches the engine.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cairn.sampling import SamplingParams
from cairn.server.errors import APIError

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    include_usage: bool = False  # send a last chunk with empty choices and the usage


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, reasoning_content, ...) pass through to the template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # cairn / vLLM extension
    min_p: float | None = None  # cairn / vLLM extension
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    ignore_eos: bool = False  # extension: keep generating past end-of-sequence tokens
    cache_prompt: bool = True  # extension: False neither reads nor writes the prefix cache
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """Raise a 400 for options that would change the output in ways cairn does not implement."""
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: only n=1", param="n", code="unsupported_value")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_value")

    def sampling_params(self, max_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        """SamplingParams for this request (raises SamplingError on out-of-range values)."""
        given = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
                                   ("min_p", self.min_p)) if v is not None}
        extra = {"user": self.user} if self.user else {}
        return SamplingParams(max_tokens=max_tokens, seed=self.seed, stop=_stop_tuple(self.stop),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              logprobs=logprobs, top_logprobs=top_logprobs, cache_prompt=self.cache_prompt,
                              extra=extra, **given)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # takes precedence over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """None: up to the rest of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, context_fill_tokens: int) -> SamplingParams:
        """`context_fill_tokens` stands in for max_tokens when none was given (the bridge then fits it)."""
        self.check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
        max_tokens = self.requested_max_tokens
        return self.sampling_params(context_fill_tokens if max_tokens is None else max_tokens,
                                    self.logprobs, self.top_logprobs or 0)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: content a string (text parts joined by newlines)."""
        return [_template_message(i, m) for i, m in enumerate(self.messages)]


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)  # the chosen token plus this many alternatives
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        self.check_supported()
        for name, unsupported in (("echo", self.echo), ("suffix", self.suffix), ("best_of", self.best_of not in
                                                                                (None, 1))):
            if unsupported:
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_value")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs is not None, self.logprobs or 0)

    def engine_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; a batch of several prompts is refused."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return p
        if len(p) != 1:
            raise APIError(400, f"a batch of {len(p)} prompts is not supported: send one prompt per request",
                           param="prompt", code="unsupported_value")
        return p[0]


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _template_message(index: int, m: ChatMessage) -> dict[str, Any]:
    out = m.model_dump(exclude_none=True)
    out["content"] = _text_content(index, m.content)
    return out


def _text_content(index: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"content part of type {kind!r} is not supported: only text parts",
                           param=f"messages.{index}.content.{j}", code="unsupported_value")
        texts.append(part["text"])
    return "\n".join(texts)
