"""Request bodies of the OpenAI API as strict pydantic models, and their conversion to engine inputs.

Every field a request may carry is declared here, on `strict.Strict` models (strict types, unknown fields
refused by name, null as the default, unimplemented fields only with their neutral value); a chat's tools
and messages are `chat.schema`'s. Range checks of the sampling fields are SamplingParams' own (its
SamplingError becomes a 400), so there is one source of truth; token ids are checked against the
vocabulary by the endpoints, which know it. A sampling field the request leaves out takes the
checkpoint's generation_config.json default when it has one (`defaults`), else SamplingParams' own.

What this module is not: response shapes (see `response_bodies`, `chat.output`) or anything that touches
the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from cairn.errors import SamplingError
from cairn.request.sampling_params import SEED_RANGE, SamplingParams, StructuredOutput
from cairn.server.chat.schema import ChatMessage, NamedToolChoice, Tools, template_message, template_variables
from cairn.server.chat.schema_keywords import refuse_unknown_keywords
from cairn.server.chat.strict import (
    CacheSalt,
    Strict,
    StrictInt,
    TokenIds,
    refuse_lone_surrogates,
    refuse_unimplemented,
)
from cairn.server.errors import APIError, from_exception, naming_max_tokens

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

class StreamOptions(Strict):
    include_usage: bool = False  # send a last chunk with empty choices and the usage
    continuous_usage_stats: Literal[False] = False  # vLLM extension: cairn sends the usage only at the end


# ---- response_format ----------------------------------------------------------------------------

class JSONSchemaFormat(Strict):
    """response_format.json_schema: the schema the output must validate against."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")  # JSON Schema (true: any JSON value)
    strict: bool | None = None  # the output always follows the schema (cairn constrains decoding either way)


class ResponseFormat(Strict):
    """response_format: "text" (unconstrained), "json_object" (any JSON object) or "json_schema"."""

    type: str
    json_schema: JSONSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        if self.json_schema is not None and self.type in ("text", "json_object"):
            raise APIError(400, f"response_format json_schema is only read with type json_schema, not {self.type}",
                           param="response_format.json_schema", code="invalid_value")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise APIError(400, "response_format json_schema needs a json_schema object",
                               param="response_format.json_schema", code="invalid_value")
            refuse_unknown_keywords(self.json_schema.schema_, "response_format.json_schema.schema")
            return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))
        raise APIError(400, f"response_format type {self.type!r} is not one of text, json_object, json_schema",
                       param="response_format.type", code="invalid_value")


# ---- the requests -------------------------------------------------------------------------------

Messages = Annotated[list[ChatMessage], Field(min_length=1)]  # a chat has at least one message


class SamplingFields(Strict):
    """Fields shared by both endpoints."""

    model: str | None = None  # None: the served model
    # the client's name for its conversation: `cairn router` sends the requests of one key to one replica (each
    # replica's cache is keyed by the prompt's content, so a replica alone needs no key)
    prompt_cache_key: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # cairn / vLLM extension
    min_p: float | None = None  # cairn / vLLM extension
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # stored nowhere; accepted as OpenAI does without `store`
    store: Literal[False] | None = None
    ignore_eos: bool = False  # extension: keep generating past end-of-sequence tokens
    cache_prompt: bool = True  # extension: False neither reads nor writes the prefix cache
    cache_salt: CacheSalt | None = None  # vLLM extension: requests of another salt share no cached prefix
    return_token_ids: bool = False  # extension (vLLM): the prompt and output token ids in the response
    n: StrictInt = 1  # choices to generate; they share the prompt's prefix (computed once)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias added to its logit
    min_tokens: int = 0  # vLLM extension: no stop before this many tokens
    include_stop_str_in_output: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension: leave special tokens' text out of the output text
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _unimplemented(cls, data: Any) -> Any:
        return refuse_unimplemented(refuse_lone_surrogates(data))

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                           code="invalid_value")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def token_ids_in_vocab(self, vocab_size: int) -> None:
        """Raise a 400 if a stop token id is outside [0, vocab_size)."""
        bad = [t for t in self.stop_token_ids or () if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}",
                           param="stop_token_ids", code="invalid_value")

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
                              cache_salt=self.cache_salt,
                              n=self.n, logit_bias=_logit_bias(self.logit_bias), min_tokens=self.min_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens,
                              structured=self.response_format.structured() if self.response_format else None,
                              extra=extra, **given)


# request fields that map one to one onto SamplingParams, and may take a generation_config.json default
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


class ChatCompletionRequest(SamplingFields):
    messages: Messages
    max_completion_tokens: int | None = None  # takes precedence over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Tools | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # False: at most one call is returned
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (enable_thinking)
    thinking_token_budget: int | None = Field(None, ge=0)  # vLLM extension: most reasoning tokens, then </think>
    continue_final_message: bool = False  # vLLM extension: the answer continues the last (assistant) message

    @property
    def requested_max_tokens(self) -> int | None:
        """None: up to the rest of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field the output limit was sent in: an error about the limit names it (see naming_max_tokens)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self, context_fill_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """`context_fill_tokens` stands in for max_tokens when none was given (the bridge then fits it)."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
        max_tokens = self.requested_max_tokens
        try:
            return self.sampling_params(context_fill_tokens if max_tokens is None else max_tokens,
                                        self.logprobs, self.top_logprobs or 0, defaults)
        except SamplingError as e:
            raise naming_max_tokens(from_exception(e), self.max_tokens_field) from None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them (see `template_message`)."""
        return [template_message(i, m) for i, m in enumerate(self.messages)]

    def template_kwargs(self) -> dict[str, Any]:
        """Variables for the chat template beside the messages (see `template_variables`)."""
        return template_variables(self.chat_template_kwargs, self.tools)

    def prompt_kwargs(self) -> dict[str, Any]:
        """template_kwargs, and how the prompt ends (`tokenize_prompt`): inside the last message when the
        answer continues it."""
        continues = {"continue_final_message": True} if self.continue_final_message else {}
        return {**self.template_kwargs(), **continues}

    def forced_tools(self) -> dict[str, dict] | None:
        """The functions a call must be made to (name -> parameters schema): all the tools for
        `required`, the named one for a named tool_choice; None when no call is forced."""
        choice, tools = self.tool_choice, {t.function.name: t.function.parameters or {} for t in self.tools or ()}
        if isinstance(choice, NamedToolChoice):
            return {choice.function.name: tools[choice.function.name]}
        return tools if choice == "required" else None

    def strict_tools(self) -> dict[str, dict] | None:
        """With tool_choice auto and a tool marked `strict`: the tools every call must follow (name ->
        parameters schema), as vLLM does; else None."""
        if self.tool_choice not in (None, "auto") or not any(t.function.strict for t in self.tools or ()):
            return None
        return {t.function.name: t.function.parameters or {} for t in self.tools or ()}

    def check_continuation(self) -> None:
        check_continuation(self.messages, self.continue_final_message)

    def check_tools(self) -> None:
        """tool_choice must name a given tool; a forced call and response_format exclude each other and
        continue_final_message; neither takes a stop (the whole output is constrained: a stop string or
        token could only cut it invalid)."""
        names = {t.function.name for t in self.tools or ()}
        forces_call = self.tool_choice not in (None, "none", "auto")
        structured = self.response_format is not None and self.response_format.type != "text"
        if forces_call and not names:
            raise APIError(400, "tool_choice requires tools", param="tool_choice", code="invalid_value")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise APIError(400, f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools",
                           param="tool_choice", code="invalid_value")
        if forces_call and structured:
            raise APIError(400, "response_format cannot be combined with a tool_choice that forces a call",
                           param="response_format", code="invalid_value")
        enforced = self.forced_tools() if forces_call else self.strict_tools()
        for i, tool in enumerate(self.tools or ()):
            if enforced is not None and tool.function.name in enforced:
                refuse_unknown_keywords(tool.function.parameters, f"tools.{i}.function.parameters")
        if self.continue_final_message and (forces_call or structured):
            field = "tool_choice" if forces_call else "response_format"
            raise APIError(400, f"{field} cannot be combined with continue_final_message: its grammar starts the "
                                "answer afresh, not inside the last message", param=field, code="invalid_value")
        if (forces_call or structured) and (self.stop or self.stop_token_ids):
            field = "stop" if self.stop else "stop_token_ids"
            what = "a tool_choice that forces a call" if forces_call else f"response_format {self.response_format.type}"
            raise APIError(400, f"{field} cannot be combined with {what}: the whole output is constrained, and a "
                                "stop inside it would end it invalid", param=field, code="invalid_value")


class CompletionRequest(SamplingFields):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=5)  # the chosen token plus this many alternatives
    message_starts: TokenIds | None = None  # extension: where chat messages start in a token-id prompt

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
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

    def checked_message_starts(self, prompt: str | list[int]) -> list[int]:
        """message_starts, valid only with a token-id prompt: increasing positions inside it."""
        starts = self.message_starts or []
        if starts and isinstance(prompt, str):
            raise APIError(400, "message_starts needs a token-id prompt", param="message_starts",
                           code="invalid_value")
        increasing = all(a < b for a, b in zip(starts, starts[1:], strict=False))
        if not increasing or any(not 0 <= s < len(prompt) for s in starts):
            raise APIError(400, f"message_starts must be increasing positions in [0, {len(prompt)})",
                           param="message_starts", code="invalid_value")
        return starts


def check_continuation(messages: Messages, continues: bool) -> None:
    """With continue_final_message the last message is an assistant's, whose text the answer continues
    (a tool call cannot be continued)."""
    if not continues:
        return
    index, last = len(messages) - 1, messages[-1]
    if last.role != "assistant":
        raise APIError(400, f"continue_final_message needs an assistant message last, not {last.role!r}",
                       param="continue_final_message", code="invalid_value")
    if last.tool_calls:
        raise APIError(400, "continue_final_message cannot continue a message that makes tool calls",
                       param=f"messages.{index}.tool_calls", code="invalid_value")


class TokenizeRequest(Strict):
    """POST /tokenize: text (`prompt`) or chat `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt a chat request with it gets: ends inside the last message
    tools: Tools | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # accepted for vLLM clients; cairn's tokenizers add none

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.continue_final_message and "add_generation_prompt" in self.model_fields_set \
                and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other: the prompt "
                             "ends inside the last message")
        if self.continue_final_message and self.messages is None:
            raise ValueError("continue_final_message needs messages")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """Variables for the chat template beside the messages (see `template_variables`)."""
        return template_variables(self.chat_template_kwargs, self.tools)


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: TokenIds


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
