"""Request preparation for /v1/chat/completions, /v1/completions, /v1/messages and /v1/responses: from the body's
bytes to what the engine bridge takes (a Submission and, for a chat, the plan its output is shaped by).

    body chunks ──(small)──> here: json.loads, validate, check ──> Submission (text; the bridge tokenizes it
                                                                    in a thread)
    body chunks ──(large)──> a worker process (see `offload`): json.loads, validate, check, render,
                             tokenize ──> Prepared: Submission holding token ids, the body without its text

A large body never becomes a Python object in the server process: its chunks go to the worker as
they arrived, and what comes back is token ids (packed, made into a list a slice at a time) and the
small fields of the body. So nothing that holds the interpreter lock for long (parsing, copying,
decoding megabytes) runs beside the engine thread.

Both paths raise the same errors: RequestValidationError for a body that is not valid JSON or does
not validate (FastAPI's handler answers it), and what the checks and the tokenizer raise (APIError,
ChatTemplateError, RequestTooLarge); WorkerDied if the worker died (this request alone, a 500);
ServerShuttingDown once the workers are closed. A Responses request's previous_response_id is looked up in the
store of responses here too (`prepare_response`), so every API's endpoint is handed a prepared request.

What this is not: submitting (`serving`) or the routes (`app`).
"""

from __future__ import annotations

import asyncio
import json
from array import array
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from cairn.errors import ChatTemplateError, PromptTooLong, RequestTooLarge
from cairn.request.prompt import tokenize_prompt
from cairn.server.anthropic.request import MessagesRequest, prepare_messages
from cairn.server.chat.output import ChatPlan
from cairn.server.engine_io.bridge import Submission
from cairn.server.engine_io.offload import Offload
from cairn.server.engine_io.workers import WorkersClosed
from cairn.server.errors import APIError, ServerShuttingDown, from_exception
from cairn.server.openai.chat import prepare_chat
from cairn.server.openai.completions import prepare_completion
from cairn.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from cairn.server.openai.responses.output import ResponseStore, Stored
from cairn.server.openai.responses.request import (
    Lookup,
    NeedsHistory,
    ResponsesRequest,
    in_responses_names,
    prepare_responses,
    previous_not_found,
)
from cairn.server.serving import ServingContext, new_request_id

M = TypeVar("M", bound=BaseModel)
UNPACK_IDS = 1 << 14  # token ids turned into Python ints at a time, back from a worker (about a millisecond)
TEXT_FIELDS = {"chat": {"messages": []}, "completion": {"prompt": ""}, "messages": {"messages": [], "system": None},
               "responses": {"input": []}}
#   what a body prepared in a worker has in place of its text (the fields are read no more once prepared)


@dataclass(frozen=True)
class Prepared:
    body: ChatCompletionRequest | CompletionRequest | MessagesRequest | ResponsesRequest  # validated; from a worker
    #   without its text (TEXT_FIELDS emptied: the submission holds their tokens), but a Responses body to store
    submission: Submission
    plan: ChatPlan | None = None  # a chat's output plan
    packed_ids: array | None = None  # in transit from a worker: the token ids (submission.tokenized has none
    #   yet), as machine integers that unpickle in one copy, unlike a list of Python ints


History = Lookup | dict[str, list] | None  # see prepare_here
JSON_ERRORS = (ValueError, RecursionError)  # what json.loads raises for a body that is not JSON
#   (json.JSONDecodeError), not UTF-8 (UnicodeDecodeError) or nested deeper than the parser recurses


def parse_body(model: type[M], data: bytes | object) -> M:
    """The JSON body (bytes, or already parsed) validated as `model`; raises RequestValidationError as
    FastAPI would."""
    if isinstance(data, bytes):
        try:
            data = json.loads(data)
        except JSON_ERRORS as e:
            raise invalid_json(e) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def invalid_json(e: ValueError | RecursionError) -> RequestValidationError:
    """What FastAPI raises for a body that is not JSON (json.JSONDecodeError) or not UTF-8; a body nested
    too deeply to parse (RecursionError) is refused the same way, saying so."""
    detail = "the body is nested too deeply" if isinstance(e, RecursionError) else getattr(e, "msg", str(e))
    return RequestValidationError([{"type": "json_invalid", "loc": ("body", getattr(e, "pos", 0)),
                                    "msg": "JSON decode error", "ctx": {"error": detail}}])


def prepare_here(ctx: ServingContext, body: bytes, kind: str, request_id: str, history: History = None) -> Prepared:
    """Parse, validate and check a `kind` request ("chat", "completion", "messages": Anthropic's, or "responses":
    OpenAI's Responses API, both prepared as the equivalent chat); its prompt is tokenized later. `history`: where
    a Responses request's previous_response_id is looked up (see `openai.responses.request.prepare_responses`)."""
    if kind == "completion":
        completion = parse_body(CompletionRequest, body)
        return Prepared(completion, prepare_completion(ctx, completion, request_id))
    if kind == "messages":
        anthropic_body = parse_body(MessagesRequest, body)
        return Prepared(anthropic_body, *prepare_messages(ctx, anthropic_body, request_id))
    if kind == "responses":
        responses_body = parse_body(ResponsesRequest, body)
        lookup = history.get if isinstance(history, dict) else history
        return Prepared(responses_body, *prepare_responses(ctx, responses_body, request_id, lookup))
    chat = parse_body(ChatCompletionRequest, body)
    return Prepared(chat, *prepare_chat(ctx, chat, request_id))


def prepare_in_worker(ctx: ServingContext, body: bytes, kind: str, request_id: str,
                      history: dict[str, list] | None = None) -> Prepared:
    """prepare_here, then render and tokenize the prompt; returns the body without its text (a Responses body to
    store keeps its input). Runs in a request worker process (ctx without bridge or metrics)."""
    prepared = prepare_here(ctx, body, kind, request_id, history)
    sub = prepared.submission
    try:
        tokenized = tokenize_prompt(ctx.tokenizer, sub.prompt, sub.messages, sub.template_kwargs, ctx.max_model_len,
                                    sub.message_starts)
    except PromptTooLong as e:
        raise RequestTooLarge(str(e)) from None
    packed_ids = array("q", tokenized.token_ids)
    sub = replace(sub, prompt=None, messages=None, template_kwargs=None, message_starts=None,
                  tokenized=replace(tokenized, token_ids=[]))
    kept = isinstance(prepared.body, ResponsesRequest) and prepared.body.store
    return Prepared(prepared.body if kept else prepared.body.model_copy(update=TEXT_FIELDS[kind]), sub,
                    prepared.plan, packed_ids)


async def prepare(ctx: ServingContext, offload: Offload, chunks: list[bytes], kind: str, request_id: str,
                  history: History = None) -> Prepared:
    """A request body as it arrived: in a worker process when it is large, else here. `history` (a Responses
    request's stored conversations): a lookup here, a dict (or None) given to a worker."""
    if not offload.is_large(chunks):
        return prepare_here(ctx, b"".join(chunks), kind, request_id, history)
    try:
        prepared = await offload.run(prepare_in_worker, chunks, kind, request_id,
                                     history if isinstance(history, dict) else None)
    except WorkersClosed:
        raise ServerShuttingDown("The server is shutting down and takes no new requests.") from None
    tokenized = replace(prepared.submission.tokenized, token_ids=await unpack_ids(prepared.packed_ids))
    return replace(prepared, submission=replace(prepared.submission, tokenized=tokenized), packed_ids=None)


async def unpack_ids(packed: array) -> list[int]:
    """The ids as a list, made UNPACK_IDS at a time with a pause between: making a quarter of a million
    Python ints in one call holds the interpreter lock for tens of milliseconds."""
    ids: list[int] = []
    for start in range(0, len(packed), UNPACK_IDS):
        ids.extend(packed[start:start + UNPACK_IDS].tolist())
        await asyncio.sleep(0)
    return ids


async def prepare_response(ctx: ServingContext, chunks: list[bytes],
                           store: ResponseStore) -> tuple[Prepared, Stored | None]:
    """A /v1/responses body prepared as a chat, and the stored response its previous_response_id names (None if
    none). A body prepared in a worker that needs one is prepared again, given it (the worker has no store)."""
    offload, request_id, seen = ctx.bridge.offload, new_request_id("resp"), {}

    def lookup(response_id: str) -> list[dict[str, Any]] | None:
        seen[response_id] = store.get(response_id)
        return None if seen[response_id] is None else seen[response_id].conversation

    try:
        try:
            p = await prepare(ctx, offload, list(chunks), "responses", request_id, lookup)
        except NeedsHistory as e:
            if lookup(e.response_id) is None:
                raise previous_not_found(e.response_id) from None
            history = {e.response_id: seen[e.response_id].conversation}
            p = await prepare(ctx, offload, chunks, "responses", request_id, history)
    except (ChatTemplateError, RequestTooLarge, APIError) as e:
        raise in_responses_names(from_exception(e, "input")) from None
    return p, seen.get(p.body.previous_response_id)
