"""The input items of OpenAI's Responses API (messages, function calls and their outputs, reasoning) as models,
and a conversation of them as the equivalent chat messages; the request around them is `request`.

    instructions, then the leading system / developer messages   -> one system message
    message items (user, system, developer, assistant; content a string or input_text / output_text parts)
                                                                  -> chat messages (parts joined)
    reasoning items (reasoning_text, else encrypted_content, else summary) -> the next assistant message's reasoning
    function_call items (call_id, name, arguments; a namespace's: <namespace>.<name>) -> that assistant message's
                                                                     tool_calls
    function_call_output items (call_id, output)                 -> tool messages

A reasoning item's `encrypted_content` is one cairn made (include reasoning.encrypted_content): ENCODED_PREFIX
and the reasoning text in base64, opaque to the client but NOT encrypted; any other is refused.
What this is not: the request's other fields, tools and refusals (`request`), the answer (`output`).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag, TypeAdapter, model_validator

from cairn.server.chat.schema import FunctionName
from cairn.server.chat.strict import Strict

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")
NAMESPACE_SEP = "."  # a namespace tool's function is the chat tool <namespace>.<name>
ENCODED_PREFIX = "cairn-reasoning:"  # an encrypted_content cairn made: this, then the reasoning text in base64


class TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # (an output_text the client sends back)
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # commentary / final_answer: how a client shows it; changes nothing here


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: FunctionName
    arguments: str  # a JSON object
    id: str | None = None
    status: str | None = None
    namespace: FunctionName | None = None  # a namespace tool's call: the chat's call is named namespace.name
    caller: dict[str, Any] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    status: str | None = None
    encrypted_content: str | None = None  # one cairn made (include reasoning.encrypted_content): the text

    @model_validator(mode="after")
    def _readable(self) -> ReasoningItem:
        if self.encrypted_content is not None:
            decode_reasoning(self.encrypted_content)
        return self

    def text(self) -> str:
        if self.content:
            return "".join(p.text for p in self.content)
        if self.encrypted_content is not None:
            return decode_reasoning(self.encrypted_content)
        return "".join(p.text for p in self.summary)


def encode_reasoning(text: str) -> str:
    return ENCODED_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(encoded: str) -> str:
    """The text of an encrypted_content cairn made (see the module docstring); ValueError for any other."""
    try:
        if encoded.startswith(ENCODED_PREFIX):
            return base64.b64decode(encoded[len(ENCODED_PREFIX):], validate=True).decode()
    except ValueError:
        pass
    raise ValueError("encrypted_content is not one this server made (cairn reads only its own)")


def item_type(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(item_type)]

ITEMS: TypeAdapter[InputItem] = TypeAdapter(InputItem)  # a stored item (a dict) as its model


def _text(content: str | list[TextPart], sep: str) -> str:
    return content if isinstance(content, str) else sep.join(p.text for p in content)


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of a conversation: the instructions and the leading system / developer messages as one
    system message, then the items (see the module docstring)."""
    system = [instructions] if instructions else []
    while items and isinstance(items[0], MessageItem) and items[0].role in ("system", "developer"):
        system.append(_text(items.pop(0).content, "\n"))
    messages = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    reasoning: str | None = None  # a reasoning item's text, for the assistant message that follows it
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, FunctionCallItem):
            name = f"{item.namespace}{NAMESPACE_SEP}{item.name}" if item.namespace else item.name
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": item.arguments}}
            if reasoning is None and messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append(_assistant("", reasoning, [call]))
        elif isinstance(item, MessageItem) and item.role == "assistant":
            messages.append(_assistant(_text(item.content, ""), reasoning))
        else:
            if reasoning is not None:  # reasoning that no answer followed: an assistant turn of its own
                messages.append(_assistant("", reasoning))
            messages.append(_other(item))
        reasoning = None
    if reasoning is not None:
        messages.append(_assistant("", reasoning))
    return messages


def _assistant(content: str, reasoning: str | None, calls: list | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _other(item: MessageItem | FunctionCallOutputItem) -> dict[str, Any]:
    if isinstance(item, FunctionCallOutputItem):
        return {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, "\n")}
    return {"role": item.role, "content": _text(item.content, "\n")}
