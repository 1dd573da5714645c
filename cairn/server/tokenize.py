"""POST /tokenize and /detokenize: text or chat messages to token ids (with the message starts), and back.

    /tokenize    {"prompt": str} or {"messages": [...], "tools", "chat_template_kwargs", "add_generation_prompt" or
                 "continue_final_message"}
                 -> {"count", "max_model_len", "tokens", "message_starts"}
    /detokenize  {"tokens": [int]} -> {"prompt": str}

`message_starts` are the positions where each chat message starts and, with the generation prompt,
where that starts (the next assistant message's start): the list /v1/completions accepts with a
token-id prompt, so a client working in token ids gets the same message-start snapshots as one
sending messages. A small body is parsed here and tokenized (or decoded) on a worker thread, not on
the event loop; a large one (offload.LARGE_INPUT_BYTES or more) is handled whole in a request worker
process, which sends back the response's JSON as bytes (`respond`): its megabytes of text, and the
millions of token ids it makes, never become Python objects in the server process, whose interpreter
lock the engine thread and the event loop share (a 5 MB /tokenize held it for a second: every stream
stopped that long).
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse, Response

from cairn.request.prompt import tokenize_prompt
from cairn.server.chat.schema import template_message
from cairn.server.engine_io.offload import Offload
from cairn.server.engine_io.workers import WorkersClosed
from cairn.server.errors import APIError, ServerShuttingDown
from cairn.server.openai.protocol import DetokenizeRequest, TokenizeRequest, check_continuation
from cairn.server.prepare import parse_body
from cairn.server.serving import ServingContext

REQUESTS = {"tokenize": TokenizeRequest, "detokenize": DetokenizeRequest}


async def respond(ctx: ServingContext, offload: Offload, chunks: list[bytes], kind: str) -> Response:
    """The response to a `kind` ("tokenize" or "detokenize") body as it arrived: a large one handled in a request
    worker process (`respond_in_worker`), a small one here. Both raise the same errors (RequestValidationError,
    APIError, ChatTemplateError)."""
    if not offload.is_large(chunks):
        body = parse_body(REQUESTS[kind], b"".join(chunks))
        return JSONResponse(await (tokenize(ctx, body) if kind == "tokenize" else detokenize(ctx, body)))
    try:
        content = await offload.run(respond_in_worker, chunks, kind)
    except WorkersClosed:
        raise ServerShuttingDown("The server is shutting down and takes no new requests.") from None
    return Response(content, media_type="application/json")


def respond_in_worker(ctx: ServingContext, data: bytes, kind: str) -> bytes:
    """In a request worker process: parse and validate the body, tokenize or decode it, and return the response's
    JSON as bytes (what JSONResponse would send), so that the server process only writes them out."""
    body = parse_body(REQUESTS[kind], data)
    result = tokenize_here(ctx, body) if kind == "tokenize" else detokenize_here(ctx, body)
    return JSONResponse(result).body


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> dict:
    """tokenize_here on a worker thread (a small body)."""
    return await asyncio.to_thread(tokenize_here, ctx, body)


def tokenize_here(ctx: ServingContext, body: TokenizeRequest) -> dict:
    ctx.check_model(body.model)
    ids, starts = (ctx.tokenizer.encode(body.prompt), []) if body.prompt is not None else _chat_tokens(ctx, body)
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "message_starts": starts}


def _chat_tokens(ctx: ServingContext, body: TokenizeRequest) -> tuple[list[int], list[int]]:
    """The token ids of body's messages rendered with the chat template, and where each message starts."""
    messages = [template_message(i, m) for i, m in enumerate(body.messages)]
    if body.continue_final_message:  # the prompt a chat request continuing its last message gets
        check_continuation(body.messages, True)
        tokenized = tokenize_prompt(ctx.tokenizer, None, messages, {**body.template_kwargs(),
                                                                    "continue_final_message": True})
        return tokenized.token_ids, [0, *tokenized.message_starts]
    ids, ends = ctx.tokenizer.encode_chat(messages, **body.template_kwargs())
    starts = [0, *ends[:-1]]
    if not body.add_generation_prompt:
        ids = ids[: ends[-1]]
    elif ends[-1] < len(ids):
        # where the generation prompt, and so the next assistant message, starts: a chat request snapshots
        # it too, and a next turn that renders the answer differently (its reasoning dropped) resumes there
        starts.append(ends[-1])
    return ids, starts


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> dict:
    """detokenize_here on a worker thread (a small body)."""
    return await asyncio.to_thread(detokenize_here, ctx, body)


def detokenize_here(ctx: ServingContext, body: DetokenizeRequest) -> dict:
    ctx.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(400, f"tokens must be in [0, {ctx.vocab_size}), got {bad[0]}", param="tokens",
                       code="invalid_value")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
