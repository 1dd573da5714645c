"""The benchmark's workloads: named, seeded streams of chat requests that diverge the way real clients do.

What it is: four of the six workloads and `all_workloads()`, which lists all six by name; the two
sessions (agentic, restart) are in `sessions.py`, the request, reply and size types and the
conversation helpers they share in `conversation.py`.

A workload is a generator: it yields a `BenchRequest`, the runner serves it and sends back the
`Reply`, and the workload decides the next request from it. Everything but the replies is
deterministic from the seed; the replies are the model's own (greedy) text, so a client's history
holds what the engine really generated.

    (a) compaction      one conversation several prefill chunks long, then the same conversation cut at
                        the message boundary nearest `keep_fraction` of its tokens plus a new instruction
    (c) interleave      for each shared fraction f: conversation A; conversation B sharing A's first
                        messages (the boundary nearest f of A's tokens; f = 0: nothing but the template's
                        first tokens); then A again (A + A's reply + a new user message)
    (d) edit            a chat (user / assistant turns); the same with the user message nearest the middle
                        rewritten; that edited prompt again (regenerate); then its continuation (+ the
                        regenerated reply + a new user message)
    (e) shared_system   `num_users` users with one long system prompt and their own question, then
                        each user's follow-up (question + reply + new question), in the same order

What it is not: a runner. Nothing here touches an engine or a server.
"""

from __future__ import annotations

from cairn.bench.conversation import (
    BenchRequest,
    RequestStream,
    Workload,
    WorkloadSizes,
    cut_index,
    history,
    message,
    message_starts,
)
from cairn.bench.sessions import agentic, restart
from cairn.bench.text import TextSource
from cairn.request.tokenizer import Tokenizer

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
    return {w.name: w for w in (
        Workload("compaction", compaction), Workload("agentic", agentic), Workload("interleave", interleave),
        Workload("edit", edit), Workload("shared_system", shared_system),
        Workload("restart", restart, needs_disk_tier=True),  # a fresh engine halfway: on the disk tier alone
    )}
