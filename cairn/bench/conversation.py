"""What a workload is made of: its sizes, the requests it sends and the replies it gets, and the
helpers that build synthetic chat conversations.

A workload is a generator (`RequestStream`): it yields a `BenchRequest`, the runner serves it and
sends back the `Reply` (the generated text as a client receives it), and the workload decides the
next request from it. `WorkloadSizes` says how large each workload is; `PRESETS` holds the `smoke`
and the `published` sizes.

What it is not: the workloads themselves (workloads.py, sessions.py) or a runner.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from cairn.bench.text import TextSource
from cairn.request.tokenizer import Tokenizer


@dataclass(frozen=True)
class WorkloadSizes:
    """How large each workload is. Token counts are approximate for non-byte tokenizers."""

    system_tokens: int  # the system prompt of a conversation
    message_tokens: int  # a synthetic history message (user / assistant / tool), on average
    reply_tokens: int  # tokens generated per request (greedy, end-of-sequence ignored: exactly this many)
    compaction_context_tokens: int  # (a) the conversation before its replay; several prefill chunks
    keep_fraction: float  # (a), (b) the share of a conversation's tokens that a compaction keeps
    instruction_tokens: int  # (a), (b) the compaction instruction appended after the cut
    agentic_turns: int  # (b) requests in the agentic session; the compaction is at two thirds
    tool_result_tokens: int  # (b), (f) a tool result, on average
    interleave_tokens: int  # (c) each conversation's first prompt
    shared_fractions: tuple[float, ...]  # (c) the shares of A's prompt that B starts with
    edit_context_tokens: int  # (d) the conversation that gets edited
    num_users: int  # (e) users sharing the system prompt
    user_tokens: int  # (e) each user's question
    restart_turns: int  # (f) requests in the restarted session; the restart is halfway


PRESETS = {
    # the demo model in seconds (the test suite's run); use --max-num-batched-tokens 256 for several chunks
    "smoke": WorkloadSizes(system_tokens=96, message_tokens=48, reply_tokens=4, compaction_context_tokens=1024,
                           keep_fraction=0.55, instruction_tokens=24, agentic_turns=12, tool_result_tokens=40,
                           interleave_tokens=384, shared_fractions=(0.0, 0.4, 0.6), edit_context_tokens=512,
                           num_users=4, user_tokens=32, restart_turns=6),
    # the published figures: Qwen3.5-0.8B dimensions on a 2-core CPU in under an hour. The compaction
    # replay is 8k tokens long (real compactions happen at tens of thousands): its warm/cold ratio is
    # about (new tokens + one forward pass) / replay length, so a short replay cannot show it
    "published": WorkloadSizes(system_tokens=256, message_tokens=96, reply_tokens=4,
                               compaction_context_tokens=8192, keep_fraction=0.7, instruction_tokens=24,
                               agentic_turns=30, tool_result_tokens=64, interleave_tokens=1024,
                               shared_fractions=(0.0, 0.4, 0.6), edit_context_tokens=1280, num_users=4,
                               user_tokens=96, restart_turns=10),
}


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, as a client sends it."""

    label: str  # what it is within the workload ("turn 7", "A again", "replay", ...)
    messages: list[dict]  # chat messages {"role", "content"}, rendered with the model's chat template
    max_tokens: int  # tokens to generate (greedy, end-of-sequence ignored unless until_end_of_turn)
    conversation: str = "main"  # the conversation it belongs to
    restart_before: bool = False  # the server restarts (a fresh engine on the same disk cache) first
    tools: list[dict] | None = None  # OpenAI function tools, rendered into the prompt by the chat template
    until_end_of_turn: bool = False  # generate until the model ends its turn (at most max_tokens), not exactly
    # max_tokens: for workloads whose turns the model writes (its calls parsed and run by the workload)


@dataclass(frozen=True)
class Reply:
    """What the client got back for a request."""

    text: str  # the generated text


RequestStream = Generator[BenchRequest, Reply, None]


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[WorkloadSizes, TextSource, Tokenizer], RequestStream] = field(repr=False)
    needs_disk_tier: bool = False  # runs only when the engine has a disk tier (CacheOptions.disk_cache)


# ---- conversation helpers --------------------------------------------------------------------------

def message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def message_starts(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """(token position where each message starts, prompt length) of the rendered conversation."""
    ids, starts = tokenizer.encode_chat(messages)
    return [0] + starts[:-1], len(ids)


def history(text: TextSource, tokenizer: Tokenizer, target_tokens: int, sizes: WorkloadSizes,
            tool_results: bool = True) -> list[dict]:
    """A conversation of about `target_tokens`: a system prompt, a user message, then exchanges of an
    assistant message and a tool result (a user message every fourth exchange), or with
    `tool_results=False` of an assistant message and a user message. It ends with a user or tool message."""
    messages = [message("system", text.words(sizes.system_tokens)),
                message("user", text.words(text.jittered(sizes.message_tokens)))]
    num_tokens = len(tokenizer.encode(messages[0]["content"] + messages[1]["content"]))
    exchange = 0
    while num_tokens < target_tokens:
        exchange += 1
        role = "user" if exchange % 4 == 0 or not tool_results else "tool"
        for r in ("assistant", role):
            content = text.words(text.jittered(sizes.message_tokens))
            messages.append(message(r, content))
            num_tokens += len(tokenizer.encode(content)) + 5
    return messages


def cut_index(tokenizer: Tokenizer, messages: list[dict], fraction: float) -> int:
    """k in [1, len(messages) - 1]: messages[:k] ends at the message boundary nearest `fraction` of the tokens."""
    starts, total = message_starts(tokenizer, messages)
    target = fraction * total
    return min(range(1, len(messages)), key=lambda k: (abs(starts[k] - target), k))
