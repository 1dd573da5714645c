"""The Messages API's `context_management` (Anthropic's context editing), as far as cairn can carry it out.

    {"edits": [{"type": "clear_thinking_20251015", "keep": ...}]}   (what Claude Code sends, keep "all")

`clear_thinking_20251015` is honoured: the thinking of every assistant message but the last `keep` ones
(`{"type": "thinking_turns", "value": N}`; 1 when keep is left out, as Anthropic's) is dropped before the chat
template renders the conversation; keep "all" (or `{"type": "all"}`) drops nothing. The template may still
leave out more (Qwen3.5's renders an assistant message's thinking only after the last user message): the edit
removes, it cannot make a template render what it does not. Other edits (`clear_tool_uses_20250919`, which
rewrites tool results past a token threshold) are refused with a 400 naming the edit's type.

What this is not: the rest of the Messages request (`messages`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from cairn.server.chat.strict import Strict
from cairn.server.errors import APIError

EDIT_TYPES = ("clear_thinking_20251015",)


class ThinkingTurns(Strict):
    type: Literal["thinking_turns"]
    value: int = Field(ge=1)  # the most recent assistant messages whose thinking is kept


class AllThinkingTurns(Strict):
    type: Literal["all"]


class ClearThinking(Strict):
    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | AllThinkingTurns | ThinkingTurns = ThinkingTurns(type="thinking_turns", value=1)

    def kept(self) -> int | None:
        """How many of the last assistant messages keep their thinking (None: all)."""
        return self.keep.value if isinstance(self.keep, ThinkingTurns) else None


class ContextManagement(Strict):
    edits: list[ClearThinking] = []

    @model_validator(mode="before")
    @classmethod
    def _edit_types(cls, data: Any) -> Any:
        edits = data.get("edits") if isinstance(data, dict) else None
        for i, edit in enumerate(edits if isinstance(edits, list) else ()):
            kind = edit.get("type") if isinstance(edit, dict) else None
            if kind not in EDIT_TYPES:
                raise APIError(400, f"context_management.edits.{i}.type {kind!r} is not supported by this server "
                                    f"(it carries out {', '.join(EDIT_TYPES)} only)",
                               param=f"context_management.edits.{i}.type", code="unsupported_value")
        return data

    def apply(self, messages: list[dict[str, Any]]) -> None:
        """Carry the edits out on chat messages (in place)."""
        for edit in self.edits:
            kept = edit.kept()
            if kept is None:
                continue
            assistant = [m for m in messages if m["role"] == "assistant"]
            for m in assistant[:max(0, len(assistant) - kept)]:
                m.pop("reasoning_content", None)
