"""Reasoning and tool-call parsers: split generated text into reasoning, content and tool calls.

Both are incremental: `feed(text)` takes the next piece of generated text and returns what can be
said for sure so far; `finish()` returns the rest once generation has ended. Feeding a text whole or
one character at a time gives the same concatenated result (the tests check every split point).
Text that might be the start of a tag (`</thi`) is held back until the next piece decides.

    ReasoningParser ("qwen3")   <think> reasoning </think> content
        The prompt of a thinking model already ends in `<think>\\n`, so generation may start inside
        the reasoning (`in_reasoning=True`); otherwise a `<think>` at the very start opens it.
    ToolCallParser ("qwen3")    content <tool_call> call </tool_call> ...
        A call is either Qwen3.5's XML style
            <function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>
        or the JSON style of Qwen3 / Qwen3-Next
            {"name": NAME, "arguments": {...}}
        A block that parses as neither (or names a function not in the request's tools) is given
        back as content, unchanged: a malformed call never fails the request.

What this is not: response shapes (see `output`) or anything that touches the engine.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
REASONING_PARSERS = ("qwen3", "none")
TOOL_CALL_PARSERS = ("qwen3", "none")


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Splits text into (reasoning, content) pieces; see the module docstring."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self._buf = ""
        self._at_start = not in_reasoning  # nothing but whitespace seen yet: a <think> may still open
        self._strip_newlines = False  # right after </think>: drop the newlines before the content

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self.in_reasoning:
                end = self._buf.find(THINK_END)
                if end < 0:
                    keep = _partial_tag_len(self._buf, THINK_END)
                    reasoning.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                reasoning.append(self._buf[:end])
                self._buf = self._buf[end + len(THINK_END):]
                self.in_reasoning, self._strip_newlines = False, True
                continue
            if self._at_start:
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf, self.in_reasoning, self._at_start = stripped[len(THINK_START):], True, False
                    continue
                if THINK_START.startswith(stripped):  # empty, or a prefix of <think>: wait
                    break
                self._at_start = False
            if self._strip_newlines:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._strip_newlines = False
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self.in_reasoning:
            return rest, ""
        return "", rest.lstrip("\n") if self._strip_newlines else rest


class NoReasoningParser:
    """--reasoning-parser none: everything is content."""

    def feed(self, text: str) -> tuple[str, str]:
        return "", text

    def finish(self) -> tuple[str, str]:
        return "", ""


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _convert_value(raw: str, schema: Any) -> Any:
    """An XML parameter value: kept as text when the schema says string, else read as JSON if it parses."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def parse_call(block: str, tools: dict[str, dict], complete: bool) -> ParsedToolCall | None:
    """One call from the text between <tool_call> and </tool_call>; None if malformed or unknown.
    `tools` maps each allowed function name to its parameters' JSON schema. `complete=False` (the
    text ended before </tool_call>) accepts an XML call missing its closing tags."""
    text = block.strip()
    if text.startswith("<function="):
        m = _FUNCTION.match(text)
        if not m or (complete and "</function>" not in text):
            return None
        name, body = m.group(1).strip(), m.group(2)
        schema = tools.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        extra = schema.get("additionalProperties") if isinstance(schema, dict) else None
        args = {p.strip(): _convert_value(v, properties.get(p.strip(), extra)) for p, v in _PARAMETER.findall(body)}
    elif text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        name, args = obj.get("name") if isinstance(obj, dict) else None, None
        if isinstance(obj, dict):
            args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
    else:
        return None
    if name not in tools:
        return None
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Splits content into (content, tool calls) pieces; see the module docstring."""

    def __init__(self, tools: dict[str, dict]):
        self.tools = tools
        self._buf = ""
        self._in_call = False
        self.num_calls = 0
        self.cut = False  # the last call was parsed from a block the output ended inside (see `finish`)

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self._buf += text
        content, calls = [], []
        while self._buf:
            if not self._in_call:
                start = self._buf.find(CALL_START)
                if start < 0:
                    keep = _partial_tag_len(self._buf, CALL_START)
                    sure = self._buf[: len(self._buf) - keep]
                    if self.num_calls and not sure.strip():  # whitespace between calls: wait for what follows
                        break
                    content.append(sure)
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                before = self._buf[:start]
                content.append(before if not self.num_calls or before.strip() else "")
                self._buf, self._in_call = self._buf[start + len(CALL_START):], True
                continue
            end = self._buf.find(CALL_END)
            if end < 0:
                break
            self._emit(self._buf[:end], True, content, calls)
            self._buf, self._in_call = self._buf[end + len(CALL_END):], False
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """What is left once the output has ended. A block it ended inside (a stop string, the end of the
        answer or max_tokens before </tool_call>) still gives its call where one parses; `cut` then says
        whether the call itself was left unfinished (an XML call before </function>)."""
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._emit(rest, False, content, calls)
            self.cut = bool(calls) and parse_call(rest, self.tools, complete=True) is None
        elif not (self.num_calls and not rest.strip()):
            content.append(rest)
        return "".join(content), calls

    def _emit(self, block: str, complete: bool, content: list[str], calls: list[ParsedToolCall]) -> None:
        call = parse_call(block, self.tools, complete)
        if call is None:
            content.append(CALL_START + block + (CALL_END if complete else ""))
            return
        calls.append(call)
        self.num_calls += 1


class NoToolCallParser:
    """tool_choice none, no tools, or --tool-call-parser none: everything is content."""

    num_calls = 0
    cut = False

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        return text, []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        return "", []
