"""POST /tokenize and /detokenize: text or chat messages to token ids (with the message starts), and back.

    /tokenize    {"prompt": str} or {"messages": [...], "tools", "chat_template_kwargs", "add_generation_prompt"}
                 -> {"count", "max_model_len", "tokens", "message_starts"}
    /detokenize  {"tokens": [int]} -> {"prompt": str}

`message_starts` are the positions where each chat message starts and, with the generation prompt,
where that starts (the next assistant message's start): the list /v1/completions accepts with a
token-id prompt, so a client working in token ids gets the same message-start snapshots as one
sending messages. Tokenizing runs on a worker thread, not on the event loop.
"""

from __future__ import annotations

import asyncio

from cairn.server.chat_schema import template_message
from cairn.server.errors import APIError
from cairn.server.generate import ServingContext
from cairn.server.protocol import DetokenizeRequest, TokenizeRequest


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> dict:
    ctx.check_model(body.model)
    if body.prompt is not None:
        ids, starts = await asyncio.to_thread(ctx.tokenizer.encode, body.prompt), []
    else:
        messages = [template_message(i, m) for i, m in enumerate(body.messages)]
        ids, ends = await asyncio.to_thread(ctx.tokenizer.encode_chat, messages, **body.template_kwargs())
        starts = [0, *ends[:-1]]
        if not body.add_generation_prompt:
            ids = ids[: ends[-1]]
        elif ends[-1] < len(ids):
            # where the generation prompt, and so the next assistant message, starts: a chat request snapshots
            # it too, and a next turn that renders the answer differently (its reasoning dropped) resumes there
            starts.append(ends[-1])
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "message_starts": starts}


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> dict:
    ctx.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(400, f"tokens must be in [0, {ctx.vocab_size}), got {bad[0]}", param="tokens",
                       code="invalid_value")
    return {"prompt": await asyncio.to_thread(ctx.tokenizer.decode, body.tokens)}
