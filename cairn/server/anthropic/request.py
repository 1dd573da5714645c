"""The Anthropic Messages API's request: its models, and the equivalent chat request (`to_chat`).

`MessagesRequest` (POST /v1/messages) and `CountTokensRequest` (/v1/messages/count_tokens, the prompt fields
alone) validate a body strictly, in this API's field names and ranges, and turn into the chat request that
runs it (system, user / assistant turns, `tool_use` -> assistant tool_calls, `tool_result` -> tool messages,
`thinking` -> reasoning_content, the `thinking` config -> the template's enable_thinking, `stop_sequences` ->
stop, a last assistant message (a prefill) -> continue_final_message). `prepare_messages` prepares that chat
request, and an error its checks raise names the fields this request sent. The answer: `messages`.

`cache_control` marks (`{"type": "ephemeral"}`, `ttl` "5m" or "1h") on `system` text blocks, `tools` and message
content blocks are cache breakpoints: `cache_marks` says where each marked block ends in the chat messages (or
which tool it is), and the prompt's tokenizing locates them in the render (`cairn.request.prompt.CacheMark`), where
the prefix cache places a snapshot; a marked `tool_use` block ends where the template's render of that call ends.
The top-level `cache_control` (automatic caching) marks the last block: the end of the last chat message's text.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, model_validator

from cairn.request.prompt import CACHE_MARKS, CacheMark
from cairn.server.anthropic.context import ContextManagement
from cairn.server.chat.output import ChatPlan
from cairn.server.chat.schema import CacheControl, FunctionName, refuse_duplicate_names
from cairn.server.chat.strict import CacheSalt, Strict, refuse_lone_surrogates, refuse_unimplemented
from cairn.server.engine_io.bridge import Submission
from cairn.server.errors import APIError, from_validation_errors, renamed
from cairn.server.openai.chat import prepare_chat
from cairn.server.openai.protocol import ChatCompletionRequest
from cairn.server.serving import ServingContext


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class DirectCaller(Strict):
    type: Literal["direct"]  # the model called the tool itself: every call cairn returns


class ToolUseBlock(Strict):
    """Also as the anthropic client dumps its own response blocks: with `caller` and `toolset_name` null."""

    type: Literal["tool_use"]
    id: str
    name: FunctionName
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = None
    toolset_name: None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: None = None


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant", "system"]  # system: a mid-conversation system message (Claude Code's)
    content: str | list[Block]


class AnthropicTool(Strict):
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # true: the tool_use input follows input_schema (constrained decoding)
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


def _unique_tool_names(tools: list[AnthropicTool]) -> list[AnthropicTool]:
    refuse_duplicate_names([t.name for t in tools], "tools.{}.name")
    return tools


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool: the tool a call must be made to (only there)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_only_with_tool(self) -> ToolChoice:
        if self.name is not None and self.type != "tool":
            raise APIError(400, f"tool_choice name is only read with type tool, not {self.type}",
                           param="tool_choice.name", code="invalid_value")
        return self


class ThinkingConfig(Strict):
    type: Literal["enabled", "adaptive", "disabled"]  # enabled / adaptive: the template's enable_thinking
    budget_tokens: int | None = Field(None, ge=0)  # enabled (only there): most thinking tokens, then it is ended
    display: Literal["summarized"] | None = None  # thinking is returned as generated

    @model_validator(mode="after")
    def _budget_only_when_enabled(self) -> ThinkingConfig:
        if self.budget_tokens is not None and self.type != "enabled":
            raise APIError(400, f"thinking budget_tokens is only read with type enabled, not {self.type}",
                           param="thinking.budget_tokens", code="invalid_value")
        return self


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")  # JSON Schema the answer's text follows (constrained decoding)


class OutputConfig(Strict):
    format: OutputFormat | None = None  # structured output: the chat's response_format json_schema
    effort: Literal["high"] | None = None  # Anthropic's default (what Claude Code sends); no other level is honoured


class Metadata(Strict):
    user_id: str | None = None  # stored nowhere


class PromptFields(Strict):
    """The fields of a Messages request that make its prompt (all that /v1/messages/count_tokens takes)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], AfterValidator(_unique_tool_names)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint at the end of the last block
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None  # clear_thinking honoured (see anthropic.context)

    @model_validator(mode="before")
    @classmethod
    def _unimplemented(cls, data: Any) -> Any:
        return refuse_unimplemented(refuse_lone_surrogates(data))

    @model_validator(mode="after")
    def _system_between_turns(self) -> PromptFields:
        if self.messages[0].role == "system":  # a system message stands between turns; the first goes in `system`
            raise APIError(400, "the first message cannot be a system message (a system prompt goes in `system`)",
                           param="messages.0.role", code="invalid_value")
        return self


class MessagesRequest(PromptFields):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range (the chat API's is 0-2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    cache_salt: CacheSalt | None = None  # cairn / vLLM extension: requests of another salt share no cached prefix

    @model_validator(mode="after")
    def _no_stop_in_a_constrained_answer(self) -> MessagesRequest:
        """The chat checks (ChatCompletionRequest.check_tools), said in this API's names."""
        forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
        structured = self.output_config is not None and self.output_config.format is not None
        if structured and forced:
            raise APIError(400, "output_config.format cannot be combined with a tool_choice that forces a call",
                           param="output_config.format", code="invalid_value")
        if self.stop_sequences and (forced or structured):
            what = "a tool_choice that forces a call" if forced else "output_config.format"
            raise APIError(400, f"stop_sequences cannot be combined with {what}: the whole output is constrained, "
                                "and a stop inside it would end it invalid", param="stop_sequences",
                           code="invalid_value")
        return self

    def to_chat(self) -> ChatCompletionRequest:
        """The equivalent chat request."""
        messages, _ = self._conversation()
        if self.context_management is not None:
            self.context_management.apply(messages)
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                                "stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p,
                                "top_k": self.top_k, "cache_salt": self.cache_salt}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": t.input_schema, "strict": t.strict}}
                             for t in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = _tool_choice(self.tool_choice)
            chat["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.thinking is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
            if self.thinking.type == "enabled":
                chat["thinking_token_budget"] = self.thinking.budget_tokens
        if self.output_config is not None and self.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        if self.messages[-1].role == "assistant":
            self._check_prefill()
            chat["continue_final_message"] = True
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:  # a value this API's fields take and the chat request's do not
            raise from_validation_errors(e.errors(include_url=False)) from None

    def _conversation(self) -> tuple[list[dict[str, Any]], list[CacheMark]]:
        """The chat messages of the system prompt and the turns, and the cache marks on their blocks and tools."""
        messages: list[dict[str, Any]] = []
        marks: list[CacheMark] = []
        if self.system:
            blocks = [TextBlock(type="text", text=self.system)] if isinstance(self.system, str) else self.system
            system, system_marks = _joined([(f"system.{j}", b) for j, b in enumerate(blocks)], "\n", 0)
            messages.append({"role": "system", "content": system})
            marks += system_marks
        for i, m in enumerate(self.messages):
            converted, on_them = _chat_messages(m, len(messages), f"messages.{i}")
            messages += converted
            marks += on_them
        for k, tool in enumerate(self.tools or ()):
            if tool.cache_control is not None:
                marks.append(CacheMark(tool.cache_control.ttl_s, f"tools.{k}", tool=k))
        if self.cache_control is not None and messages and isinstance(messages[-1].get("content"), str):
            last = len(messages) - 1  # automatic caching: the last block, which ends the last message's text
            marks.append(CacheMark(self.cache_control.ttl_s, "cache_control", message=last,
                                   content_end=len(messages[last]["content"])))
        return messages, marks

    def cache_marks(self) -> list[CacheMark]:
        """Where this request's cache_control marks end, in the chat messages of `to_chat`: in a message's text,
        after one of its tool calls (a tool_use block), or after a tool of the template's tools."""
        return self._conversation()[1]

    def _check_prefill(self) -> None:
        """A last assistant message is a prefill: the answer continues its text (`continue_final_message`),
        so it holds text alone, no thinking comes before the answer and no structured output's grammar
        (which starts an answer afresh) constrains it."""
        index, last = len(self.messages) - 1, self.messages[-1]
        kinds = [] if isinstance(last.content, str) else [b.type for b in last.content if b.type != "text"]
        if kinds:
            raise APIError(400, f"a last assistant message (a prefill, which the answer continues) may hold text "
                                f"blocks only, not {kinds[0]}", param=f"messages.{index}.content", code="invalid_value")
        if self.output_config is not None and self.output_config.format is not None:
            raise APIError(400, "output_config.format cannot be combined with a last assistant message (a prefill): "
                                "its grammar starts the answer afresh", param="output_config.format",
                           code="invalid_value")
        if self.thinking is not None and self.thinking.type != "disabled":
            raise APIError(400, f"thinking {self.thinking.type} cannot be combined with a last assistant message (a "
                                "prefill): the answer continues its text, after no thinking", param="thinking",
                           code="invalid_value")


# the chat request's field paths as this API names them, for an error the chat's checks raise (`prepare_messages`)
CHAT_PATHS = ((re.compile(r"\btools\.(\d+)\.function\.parameters\b"), r"tools.\1.input_schema"),
              (re.compile(r"\btools\.(\d+)\.function\.name\b"), r"tools.\1.name"),
              (re.compile(r"\bresponse_format\.json_schema\.schema\b"), "output_config.format.schema"),
              (re.compile(r"\bresponse_format\b"), "output_config.format"),
              (re.compile(r"\bthinking_token_budget\b"), "thinking.budget_tokens"))


def in_anthropic_names(e: APIError) -> APIError:
    """`e`, raised by the equivalent chat request's checks, naming the fields this request sent."""
    return renamed(e, CHAT_PATHS)


def prepare_messages(ctx: ServingContext, body: MessagesRequest | CountTokensRequest,
                     request_id: str) -> tuple[Submission, ChatPlan]:
    """prepare_chat of the equivalent chat request; an error it raises names this API's fields."""
    try:
        sub, plan = prepare_chat(ctx, body.to_chat(), request_id)
    except APIError as e:
        raise in_anthropic_names(e) from None
    marks = body.cache_marks()
    if marks:  # located where the prompt is rendered (cairn.request.prompt.tokenize_prompt)
        sub = replace(sub, template_kwargs={**(sub.template_kwargs or {}), CACHE_MARKS: marks})
    return sub, plan


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice type tool needs a name", param="tool_choice.name", code="invalid_value")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _joined(blocks: list[tuple[str, TextBlock]], separator: str, message: int, offset: int = 0
            ) -> tuple[str, list[CacheMark]]:
    """The texts of `blocks` ((the block's field, the block)) joined by `separator`, and a mark at the end of each
    marked block, in the content of chat message `message`, which holds the joined text from character `offset` on."""
    marks, end = [], offset
    for j, (where, b) in enumerate(blocks):
        end += len(b.text) + (len(separator) if j else 0)
        if b.cache_control is not None:
            marks.append(CacheMark(b.cache_control.ttl_s, where, message=message, content_end=end))
    return separator.join(b.text for _, b in blocks), marks


def _chat_messages(m: Message, first: int = 0, where: str = "messages") -> tuple[list[dict[str, Any]], list[CacheMark]]:
    """One Anthropic message as chat messages (the first of them is chat message `first`; `where`: the message's
    field), and the cache marks on its blocks: a user turn's tool results become tool messages."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}], []
    texts = [(f"{where}.content.{j}", b) for j, b in enumerate(m.content) if isinstance(b, TextBlock)]
    if m.role == "system":  # rendered where it stands, as the chat template renders a system message there
        if len(texts) != len(m.content):
            raise APIError(400, "a system message may hold text blocks only", param="messages", code="invalid_value")
        content, marks = _joined(texts, "\n", first)
        return [{"role": "system", "content": content}], marks
    if m.role == "assistant":
        content, marks = _joined(texts, "", first)
        uses = [(j, b) for j, b in enumerate(m.content) if isinstance(b, ToolUseBlock)]
        marks += [CacheMark(b.cache_control.ttl_s, f"{where}.content.{j}", message=first, call=k)
                  for k, (j, b) in enumerate(uses) if b.cache_control is not None]
        out: dict[str, Any] = {"role": "assistant", "content": content}
        thinking = [b.thinking for b in m.content if isinstance(b, ThinkingBlock)]
        if thinking:
            out["reasoning_content"] = "".join(thinking)
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in m.content if isinstance(b, ToolUseBlock)]
        if calls:
            out["tool_calls"] = calls
        return [out], marks
    if any(isinstance(b, ToolUseBlock | ThinkingBlock) for b in m.content):
        raise APIError(400, "a user message cannot carry tool_use or thinking blocks", param="messages",
                       code="invalid_value")
    out_messages: list[dict[str, Any]] = []
    marks = []
    for j, b in enumerate(m.content):
        if isinstance(b, ToolResultBlock):
            content, on_it = _result_text(b, first + len(out_messages), f"{where}.content.{j}")
            out_messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
            marks += on_it
    if texts or not out_messages:
        content, on_texts = _joined(texts, "\n", first + len(out_messages))
        out_messages.append({"role": "user", "content": content})
        marks += on_texts
    return out_messages, marks


def _result_text(b: ToolResultBlock, message: int, where: str) -> tuple[str, list[CacheMark]]:
    """A tool result's text (in chat message `message`; `where`: the block's field), and the marks on it and its
    text blocks."""
    prefix = "Error: " if b.is_error else ""
    if isinstance(b.content, str) or b.content is None:
        text, marks = b.content or "", []
    else:
        text, marks = _joined([(f"{where}.content.{k}", t) for k, t in enumerate(b.content)], "\n", message,
                              len(prefix))
    if b.cache_control is not None:
        marks.append(CacheMark(b.cache_control.ttl_s, where, message=message, content_end=len(prefix + text)))
    return prefix + text, marks


class CountTokensRequest(PromptFields):
    """/v1/messages/count_tokens: a Messages request's prompt fields alone."""

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request of a Messages request with these fields (its prompt: max_tokens does not enter it)."""
        return MessagesRequest.model_construct(**dict(self), max_tokens=1).to_chat()

    def cache_marks(self) -> list[CacheMark]:
        """The cache marks of a Messages request with these fields (see MessagesRequest.cache_marks)."""
        return MessagesRequest.model_construct(**dict(self), max_tokens=1).cache_marks()
