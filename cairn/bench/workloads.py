"""The benchmark's workloads: named, seeded streams of chat requests that diverge the way real clients do.

What it is: the request and reply types, the sizes (`WorkloadSizes`, with a `smoke` and a `published`
preset), the helpers that build synthetic conversations, and four of the six workloads; the two
sessions (agentic, restart) are in `sessions.py`. `all_workloads()` lists all six by name.

A workload is a generator: it yields a `BenchRequest`, the runner serves it and sends back the
`Reply` (the generated text as a client receives it), and the workload decides the next request
from it. Everything but the replies is deterministic from the seed; the replies are the model's own
(greedy) text, so a client's history holds what the engine really generated.

    compaction      one conversation several prefill chunks long, then the same conversation cut at
                    the message boundary nearest `keep_fraction` of its tokens plus a new instruction
    interleave      for each shared fraction f: conversation A; conversation B sharing A's first
                    messages (the boundary nearest f of A's tokens; f = 0: nothing but the template's
                    first tokens); then A again (A + A's reply + a new user message)
    edit            a chat (user / assistant turns); the same with the user message nearest the middle
                    rewritten; that edited prompt again (regenerate); then its continuation (+ the
                    regenerated reply + a new user message)
    shared_system   `num_users` users with one long system prompt and their own question, then
                    each user's follow-up (question + reply + new question), in the same order

What it is not: a runner. Nothing here touches an engine or a server.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from cairn.bench.text import TextSource
from cairn.tokenizer import Tokenizer


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
    max_tokens: int  # tokens to generate (greedy, end-of-sequence ignored)
    conversation: str = "main"  # the conversation it belongs to
    restart_before: bool = False  # the server restarts (a fresh engine on the same disk cache) first


@dataclass(frozen=True)
class Reply:
    """What the client got back for a request."""

    text: str  # the generated text


RequestStream = Generator[BenchRequest, Reply, None]


@dataclass(frozen=True)
class Workload:
    name: str
    summary: str  # one line, for tables
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


# ---- (a) compaction replay -------------------------------------------------------------------------

def compaction(sizes: WorkloadSizes, text: TextSource, tokenizer: Tokenizer) -> RequestStream:
    conversation = history(text, tokenizer, sizes.compaction_context_tokens, sizes)
    yield BenchRequest("conversation", conversation, sizes.reply_tokens)
    k = cut_index(tokenizer, conversation, sizes.keep_fraction)
    instruction = message("user", "Compact: summarize the work so far. " + text.words(sizes.instruction_tokens))
    yield BenchRequest("replay", conversation[:k] + [instruction], sizes.reply_tokens)


# ---- (c) interleaved conversations ------------------------------------------------------------------

def interleave(sizes: WorkloadSizes, text: TextSource, tokenizer: Tokenizer) -> RequestStream:
    for f in sizes.shared_fractions:
        tag = f"{round(100 * f)}%"
        a = history(text, tokenizer, sizes.interleave_tokens, sizes)
        other = history(text, tokenizer, sizes.interleave_tokens, sizes)
        k = cut_index(tokenizer, a, f) if f > 0 else 0
        b = a[:k] + other[k:]  # the same roles as A, diverging where message k starts
        reply = yield BenchRequest(f"A ({tag})", a, sizes.reply_tokens, conversation=f"A{tag}")
        yield BenchRequest(f"B shares {tag}", b, sizes.reply_tokens, conversation=f"B{tag}")
        again = a + [message("assistant", reply.text), message("user", text.words(sizes.message_tokens))]
        yield BenchRequest(f"A again ({tag})", again, sizes.reply_tokens, conversation=f"A{tag}")


# ---- (d) edit mid-history and regenerate -------------------------------------------------------------

def edit(sizes: WorkloadSizes, text: TextSource, tokenizer: Tokenizer) -> RequestStream:
    conversation = history(text, tokenizer, sizes.edit_context_tokens, sizes, tool_results=False)
    yield BenchRequest("original", conversation, sizes.reply_tokens)
    starts, total = message_starts(tokenizer, conversation)
    users = [i for i, m in enumerate(conversation) if m["role"] == "user" and i < len(conversation) - 1]
    i = min(users, key=lambda j: abs(starts[j] - total / 2))
    edited = list(conversation)
    edited[i] = message("user", "Edited: " + text.words(text.jittered(sizes.message_tokens)))
    yield BenchRequest(f"edit message {i}", edited, sizes.reply_tokens)
    reply = yield BenchRequest("regenerate", edited, sizes.reply_tokens)
    follow_up = edited + [message("assistant", reply.text), message("user", text.words(sizes.message_tokens))]
    yield BenchRequest("continue", follow_up, sizes.reply_tokens)


# ---- (e) many users, one system prompt ----------------------------------------------------------------

def shared_system(sizes: WorkloadSizes, text: TextSource, tokenizer: Tokenizer) -> RequestStream:
    system = message("system", text.words(sizes.system_tokens * 3))
    chats = [[system, message("user", text.words(text.jittered(sizes.user_tokens)))] for _ in range(sizes.num_users)]
    for u, chat in enumerate(chats):
        reply = yield BenchRequest(f"user {u}", chat, sizes.reply_tokens, conversation=f"user{u}")
        chats[u] = chat + [message("assistant", reply.text),
                           message("user", text.words(text.jittered(sizes.user_tokens)))]
    for u, chat in enumerate(chats):
        yield BenchRequest(f"user {u} again", chat, sizes.reply_tokens, conversation=f"user{u}")


def all_workloads() -> dict[str, Workload]:
    from cairn.bench.sessions import agentic, restart

    return {w.name: w for w in (
        Workload("compaction", "(a) a long conversation, then the same cut far back + a new instruction", compaction),
        Workload("agentic", "(b) agentic session: tool results, reasoning stripped, compaction at 2/3", agentic),
        Workload("interleave", "(c) conversations A, B (sharing 0/40/60% of A), A again", interleave),
        Workload("edit", "(d) an edit mid-history, a regenerate, a continuation", edit),
        Workload("shared_system", "(e) many users sharing one long system prompt, two rounds", shared_system),
        Workload("restart", "(f) a session whose server restarts halfway (needs the disk tier)", restart,
                 needs_disk_tier=True),
    )}
