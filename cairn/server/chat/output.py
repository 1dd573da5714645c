"""Chat output shaping: generated text -> reasoning, content and tool calls, for one chat request.

`ChatPlan` is decided once per request from the request and the server's flags: which parsers run,
and the grammar of the output (cairn.grammar): a call forced by `tool_choice` (`required` or a named
function, in the template's call format: `call_grammar`; it skips the reasoning), the calls of
`strict` tools, response_format, and the thinking budget, the last three after the reasoning block
the template opened, if any. `ChatShaper` then runs the text
through the reasoning parser, its content through the tool-call parser, and yields `ChatDelta`s;
the OpenAI (`openai_*`) and Anthropic (`anthropic.messages`) shapes are built from those.

    generated text ─> ReasoningParser ─┬─ reasoning ────────────────> reasoning_content / thinking
                                       └─ content ─> ToolCallParser ─┬─ content ─> content / text
                                                                     └─ calls ───> tool_calls / tool_use

What this is not: it does not talk to the engine, and it does not decide errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from cairn.errors import ChatTemplateError
from cairn.request.grammar import lark_tag
from cairn.request.sampling_params import StructuredOutput
from cairn.request.tokenizer import Tokenizer
from cairn.server.chat.call_grammar import call_format, calls_grammar
from cairn.server.chat.parsers import (
    CALL_END,
    CALL_START,
    THINK_END,
    THINK_START,
    NoReasoningParser,
    NoToolCallParser,
    ParsedToolCall,
    ReasoningParser,
    ToolCallParser,
)

PROBE = [{"role": "user", "content": "probe"}]  # rendered to see how the generation prompt ends
PROBE_WITH_SYSTEM = [{"role": "system", "content": "probe"}, *PROBE]  # for a template that requires a system message


@dataclass(frozen=True)
class ChatPlan:
    """How one chat request's output is constrained and parsed."""

    reasoning_parser: str  # "qwen3" or "none"
    starts_in_reasoning: bool  # the prompt ends inside <think> (the template opened it)
    tools: dict[str, dict] | None  # function name -> parameters schema; None: no tool-call parsing
    generation_prefix: str = ""  # text appended to the prompt, which the answer continues
    parallel_tool_calls: bool = True
    structured: StructuredOutput | None = None  # the grammar of the output (see cairn.grammar)

    @property
    def markers(self) -> tuple[str, ...]:
        """The tags the parsers of this plan read in the generated text: kept in it even where the tokenizer
        has them as special tokens, whose text skip_special_tokens otherwise leaves out."""
        reasoning = (THINK_START, THINK_END) if self.reasoning_parser != "none" else ()
        return reasoning + ((CALL_START, CALL_END) if self.tools is not None else ())


def opens_reasoning(tokenizer: Tokenizer, template_kwargs: dict[str, Any]) -> bool:
    """Whether this template, with these kwargs, ends the generation prompt inside <think> (False when it
    refuses both probe conversations: the request's own conversation is then refused too, or says)."""
    kwargs = {k: v for k, v in template_kwargs.items() if k != "tools"}
    for probe in (PROBE, PROBE_WITH_SYSTEM):
        try:
            rendered = tokenizer.render_chat(probe, add_generation_prompt=True, **kwargs)
            break
        except ChatTemplateError:
            continue
    else:
        return False
    tail = rendered.rstrip()
    return tail.endswith(THINK_START) and THINK_END not in tail[-len(THINK_START) - 2:]


@dataclass(frozen=True)
class Constraints:
    """What a request asks of its output, beside the parsers: the tools a call is forced to (all of them
    for tool_choice `required`, one for a named function), the strict tools of tool_choice auto,
    response_format, the thinking budget."""

    forced: dict[str, dict] | None = None
    one_call: bool = False  # a named function: exactly one call
    strict: dict[str, dict] | None = None  # tool_choice auto with `strict` tools: the calls made follow these
    response_format: StructuredOutput | None = None
    think_budget: int | None = None
    continues: bool = False  # continue_final_message: the answer goes on from the last message's text


def plan_chat(tokenizer: Tokenizer, reasoning_parser: str, tool_call_parser: str, template_kwargs: dict[str, Any],
              tools: dict[str, dict] | None, parallel_tool_calls: bool,
              constraints: Constraints = Constraints()) -> ChatPlan:
    """The plan for a request; `tools` is None when calls are not parsed (no tools, tool_choice none).
    A forced call skips the reasoning (the block the template opened is closed in the prompt); a
    response_format, strict tools or a thinking budget let the reasoning run first (bounded by the
    budget). A response_format leaves strict tools unconstrained (the answer is its JSON)."""
    in_reasoning = (reasoning_parser != "none" and not constraints.continues  # (a continued message is content)
                    and opens_reasoning(tokenizer, template_kwargs))
    if tool_call_parser == "none":
        tools = None
    prefix, structured = "", constraints.response_format
    if constraints.forced is not None:
        structured = _calls(tokenizer, constraints.forced, parallel_tool_calls and not constraints.one_call)
        prefix = "\n" + THINK_END + "\n\n" if in_reasoning else ""
        in_reasoning = False
    elif constraints.strict is not None and structured is None and tools is not None:
        structured = _calls(tokenizer, constraints.strict, parallel_tool_calls, optional=True)
    elif structured is None and in_reasoning and constraints.think_budget is not None:
        structured = StructuredOutput("text")
    if structured is not None and in_reasoning:
        structured = replace(structured, think_end=THINK_END, think_budget=constraints.think_budget)
    return ChatPlan(reasoning_parser, in_reasoning, tools, prefix, parallel_tool_calls, structured)


def _calls(tokenizer: Tokenizer, tools: dict[str, dict], parallel: bool, optional: bool = False) -> StructuredOutput:
    """The grammar of calls to `tools` in the template's call format (see `call_grammar`)."""
    grammar = calls_grammar(tools, call_format(tokenizer.template_source), parallel,
                            lambda text: lark_tag(tokenizer, text), optional)
    return StructuredOutput("lark", grammar)


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)


class ChatShaper:
    """Feeds generated text through the parsers of a ChatPlan; keeps what the whole message needs."""

    def __init__(self, plan: ChatPlan):
        self.plan = plan
        self.reasoning = ReasoningParser(plan.starts_in_reasoning) if plan.reasoning_parser != "none" \
            else NoReasoningParser()
        self.calls = ToolCallParser(plan.tools) if plan.tools is not None else NoToolCallParser()
        self.message = ChatDelta()  # everything so far
        self._num_calls_kept = 0

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        """What `text` (the next generated piece) adds; `final`: generation has ended, flush everything."""
        reasoning, content = self.reasoning.feed(text)
        if final:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return self._through_calls(reasoning, content, final)

    def _through_calls(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        content, calls = self.calls.feed(content)
        if final:
            more_content, more_calls = self.calls.finish()
            content, calls = content + more_content, calls + more_calls
        if not self.plan.parallel_tool_calls:
            calls = calls[: max(0, 1 - self._num_calls_kept)]
        self._num_calls_kept += len(calls)
        delta = ChatDelta(reasoning, content, calls)
        self.message.reasoning += reasoning
        self.message.content += content
        self.message.calls += calls
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when the answer made calls, finished the last one and ended on its own ("stop"), else
        the engine's reason.

        An answer max_tokens cut ("length") keeps "length" even when calls were parsed: the last call may
        be incomplete (a forced call cut inside its parameters parses with those missing). Its calls are
        still returned as parsed, as OpenAI returns a call's truncated arguments with "length" (Anthropic:
        the tool_use block with stop_reason "max_tokens"); a client must not run the calls of such an
        answer, and retries with a larger max_tokens. So does an answer that ended inside its last call
        (a stop string, or the model's end of turn, before </function>): "stop", not "tool_calls"."""
        if self.message.calls and engine_reason == "stop" and not self.calls.cut:
            return "tool_calls"
        return engine_reason


# ---- OpenAI shapes ------------------------------------------------------------------------------

def openai_tool_call(call: ParsedToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def openai_message(message: ChatDelta) -> dict[str, Any]:
    """The assistant message of a whole chat.completion."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content if message.content or not message.calls
                           else None}
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    if message.calls:
        out["tool_calls"] = [openai_tool_call(c) for c in message.calls]
    return out


def openai_deltas(delta: ChatDelta, first_call_index: int) -> list[dict[str, Any]]:
    """The `delta` objects of stream chunks for this piece: reasoning, content, then each call as two
    fragments (id and name, then the arguments), the way the openai client reassembles them."""
    out: list[dict[str, Any]] = []
    if delta.reasoning:
        out.append({"reasoning_content": delta.reasoning})
    if delta.content:
        out.append({"content": delta.content})
    for i, call in enumerate(delta.calls, start=first_call_index):
        out.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return out


def tool_arguments(call: ParsedToolCall) -> dict[str, Any]:
    return json.loads(call.arguments)
