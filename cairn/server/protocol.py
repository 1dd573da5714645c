"""Request bodies of the OpenAI API as pydantic models, and their conversion to engine inputs.

Only the fields cairn honours are declared; unknown fields are ignored (clients send many). Fields
that would change the output in a way cairn cannot do (echo, a batch of prompts, non-text content)
are refused with a 400 rather than silently ignored. Range checks of the sampling fields are
SamplingParams' own (its SamplingError becomes a 400), so there is one source of truth. A sampling
field the request leaves out takes the checkpoint's generation_config.json default when it has one
(`defaults`), else SamplingParams' own default.

What this module is not: response shapes (see `responses`) or anything that touches the engine.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cairn.sampling import SamplingParams, StructuredOutput
from cairn.server.errors import APIError

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    include_usage: bool = False  # send a last chunk with empty choices and the usage


class JSONSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the output must validate against."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")  # JSON Schema (true: any JSON value)
    strict: bool | None = None  # the output always follows the schema (cairn constrains decoding either way)


class ResponseFormat(BaseModel):
    """response_format: "text" (unconstrained), "json_object" (any JSON object) or "json_schema"."""

    type: str
    json_schema: JSONSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise APIError(400, "response_format json_schema needs a json_schema object",
                               param="response_format.json_schema", code="invalid_value")
            return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))
        raise APIError(400, f"response_format type {self.type!r} is not one of text, json_object, json_schema",
                       param="response_format.type", code="invalid_value")


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
    repetition_penalty: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias added to its logit
    min_tokens: int = 0  # vLLM extension: no stop before this many tokens
    include_stop_str_in_output: bool = False  # vLLM extension
    response_format: ResponseFormat | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: bool, top_logprobs: int,
                        defaults: dict | None = None) -> SamplingParams:
        """SamplingParams for this request (raises SamplingError on out-of-range values). `defaults`:
        the checkpoint's generation_config.json values, for the fields this request leaves out."""
        given = {**(defaults or {}), **{k: v for k, v in self.model_dump(include=set(SAMPLING_FIELDS)).items()
                                        if v is not None}}
        extra = {"user": self.user} if self.user else {}
        return SamplingParams(max_tokens=max_tokens, seed=self.seed, stop=_stop_tuple(self.stop),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              logprobs=logprobs, top_logprobs=top_logprobs, cache_prompt=self.cache_prompt,
                              n=self.n, logit_bias=_logit_bias(self.logit_bias), min_tokens=self.min_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              structured=self.response_format.structured() if self.response_format else None,
                              extra=extra, **given)


# request fields that map one to one onto SamplingParams, and may take a generation_config.json default
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # takes precedence over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """None: up to the rest of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, context_fill_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """`context_fill_tokens` stands in for max_tokens when none was given (the bridge then fits it)."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
        max_tokens = self.requested_max_tokens
        return self.sampling_params(context_fill_tokens if max_tokens is None else max_tokens,
                                    self.logprobs, self.top_logprobs or 0, defaults)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: content a string (text parts joined by newlines)."""
        return [_template_message(i, m) for i, m in enumerate(self.messages)]


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)  # the chosen token plus this many alternatives
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        for name, unsupported in (("echo", self.echo), ("suffix", self.suffix), ("best_of", self.best_of not in
                                                                                (None, 1))):
            if unsupported:
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported_value")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs is not None, self.logprobs or 0, defaults)

    def engine_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; a batch of several prompts is refused."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return p
        if len(p) != 1:
            raise APIError(400, f"a batch of {len(p)} prompts is not supported: send one prompt per request",
                           param="prompt", code="unsupported_value")
        return p[0]


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not an integer is a 400."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            pairs.append((int(key), float(value)))
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias",
                           code="invalid_value") from None
    return tuple(pairs)


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
