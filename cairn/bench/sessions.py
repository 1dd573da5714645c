"""The two session workloads: an agentic session with a compaction, and a session across a restart.

What it is: (b) `agentic` and (f) `restart`, in the generator protocol of `conversation.py`. Each turn
sends the whole history; the model's reply goes back into it the way a client that strips
reasoning keeps it (`client_keeps`), followed by a tool result:

    turn t prompt:   system | task | (assistant kept_0 + call_0 | tool result_0) ... (assistant kept_t-1 + ...)
    each assistant message carries a real tool call, answered by the tool message.
    every fifth turn the user also adds a message after the tool result.

    (b) at turn floor(2 N / 3) the client compacts: it sends the history cut at the message boundary
        nearest `keep_fraction` of its tokens plus a compaction instruction; from then on the history
        is system | task | user "Summary ..." (the compaction's kept reply) and the session goes on.
    (f) before turn floor(N / 2) the server restarts (the runner builds a fresh engine on the same
        disk cache directory); the client resends its history unchanged.

What it is not: a model of any one client's exact prompts; the lengths come from `WorkloadSizes`.
"""

from __future__ import annotations

from cairn.bench.conversation import BenchRequest, RequestStream, WorkloadSizes, cut_index, message
from cairn.bench.text import TextSource
from cairn.request.tokenizer import Tokenizer


def client_keeps(reply_text: str) -> str:
    """The reply a reasoning-stripping client keeps in its history.

    A reasoning model's reply is `<think>...</think>answer`, and clients keep only the answer, so the
    next prompt leaves the generated tokens right at the end of the previous prompt. Random weights
    write no think block, so the first half of the generated text stands for it and is dropped.
    """
    return reply_text[len(reply_text) // 2:]


def _opening(sizes: WorkloadSizes, text: TextSource) -> list[dict]:
    return [message("system", text.words(sizes.system_tokens)),
            message("user", "Task: " + text.words(text.jittered(sizes.message_tokens)))]


def tool_call_turn(turn: int, kept_reply: str, command: str, result: str) -> list[dict]:
    """An assistant message that calls a tool (id, function name, arguments as the chat template takes
    them: a dict; the server also accepts OpenAI's JSON string), then that tool's result."""
    call_id = f"call_{turn}"
    call = {"id": call_id, "type": "function",
            "function": {"name": "run_command", "arguments": {"command": command}}}
    return [{"role": "assistant", "content": kept_reply, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def _after_turn(turn: int, messages: list[dict], reply_text: str, sizes: WorkloadSizes,
                text: TextSource) -> list[dict]:
    """The history after a turn: the kept reply with its tool call, the tool's result, and every fifth
    turn a user message."""
    grown = messages + tool_call_turn(turn, client_keeps(reply_text), text.words(8),
                                      text.words(text.jittered(sizes.tool_result_tokens)))
    if turn % 5 == 4:
        grown.append(message("user", text.words(text.jittered(sizes.message_tokens // 2))))
    return grown


def agentic(sizes: WorkloadSizes, text: TextSource, tokenizer: Tokenizer) -> RequestStream:
    messages = _opening(sizes, text)
    compact_at = 2 * sizes.agentic_turns // 3
    for turn in range(sizes.agentic_turns):
        if turn == compact_at and len(messages) > 2:
            k = cut_index(tokenizer, messages, sizes.keep_fraction)
            instruction = message("user", "Compact: summarize the work so far. " + text.words(sizes.instruction_tokens))
            reply = yield BenchRequest(f"turn {turn} (compaction)", messages[:k] + [instruction], sizes.reply_tokens)
            messages = messages[:2] + [message("user", "Summary of the work so far: " + client_keeps(reply.text))]
            continue
        reply = yield BenchRequest(f"turn {turn}", messages, sizes.reply_tokens)
        messages = _after_turn(turn, messages, reply.text, sizes, text)


def restart(sizes: WorkloadSizes, text: TextSource, tokenizer: Tokenizer) -> RequestStream:
    messages = _opening(sizes, text)
    restart_at = sizes.restart_turns // 2
    for turn in range(sizes.restart_turns):
        label = f"turn {turn}" + (" (after restart)" if turn == restart_at else "")
        reply = yield BenchRequest(label, messages, sizes.reply_tokens, restart_before=turn == restart_at)
        messages = _after_turn(turn, messages, reply.text, sizes, text)
