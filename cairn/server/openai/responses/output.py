"""POST /v1/responses (the answer side) and GET / DELETE /v1/responses/{id}: OpenAI's `response` object, whole
or as the Responses API's SSE events; the request side is `request`.

A request prepared as a chat (see `request`) runs the chat path; what the chat shaper (`chat.output`)
makes of the generated text becomes the response's output items, in order: a `reasoning` item (the thinking
text as `reasoning_text` content, an empty summary), a `message` item (`output_text`) when there is text, and
one `function_call` item per tool call. status is "completed", or "incomplete" with incomplete_details.reason
"max_output_tokens" when the output limit (or the context) cut the answer. usage: input_tokens counts the
prompt, input_tokens_details.cached_tokens those resumed from cairn's prefix cache (the chat path's
cached_tokens), output_tokens_details.reasoning_tokens the thinking; `usage.cairn` is the chat path's cache report.

Streamed, each event is `event: <type>` and `data: <json>` with a rising sequence_number:

    response.created, response.in_progress, then per output item: response.output_item.added,
    (reasoning) response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
    response.content_part.done; (message) the same with response.output_text.delta / .done; (function call)
    response.function_call_arguments.delta / .done; then response.output_item.done; finally
    response.completed or response.incomplete, carrying the whole response (an error: an `error` event).

A client that disconnects aborts the generation, as on the chat path. Every answer carries the response id
in an `x-cairn-response-id` header (which `cairn router` remembers, to send its follow-ups to this replica).
`ResponseStore` keeps stored responses (`store`, default true) in memory: at most MAX_STORED_RESPONSES of them
holding at most MAX_STORED_BYTES (their JSON size), the least recently stored or read evicted first; each holds
its whole conversation, so a follow-up of an evicted response's follow-up still has it all. A restart empties it.
What this is not: the request's conversion (`request`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cairn.engine.outputs import Completion
from cairn.errors import ChatTemplateError, RequestTooLarge
from cairn.request.tokenizer import Tokenizer
from cairn.server.chat.output import ChatDelta, ChatPlan, ChatShaper
from cairn.server.chat.parsers import THINK_END, THINK_START, ParsedToolCall
from cairn.server.engine_io.bridge import Submission
from cairn.server.errors import APIError, from_exception
from cairn.server.openai.response_bodies import usage_of
from cairn.server.openai.responses.items import encode_reasoning
from cairn.server.openai.responses.request import (
    ENCRYPTED_REASONING,
    NamespaceTool,
    ResponsesRequest,
    Tool,
    in_responses_names,
)
from cairn.server.serving import Generation, ServingContext, SSEResponse, start_generation

RESPONSE_ID_HEADER = "x-cairn-response-id"
MAX_STORED_RESPONSES = 1024  # ResponseStore's count cap
MAX_STORED_BYTES = 256 << 20  # ResponseStore's byte cap (the JSON size of what it holds)


# ---- the store ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the response object, as GET /v1/responses/{id} returns it
    conversation: list[dict[str, Any]]  # every item up to its output, as input items (previous_response_id)
    conversation_bytes: int  # its size as JSON (counted a turn at a time: see put)
    size: int  # bytes, as JSON, of the response and the conversation


class ResponseStore:
    """Stored responses by id, at most `max_responses` of them holding at most `max_bytes` (as JSON): the least
    recently stored or read is evicted first. On the event loop only (no lock)."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._held: OrderedDict[str, Stored] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._held)

    def put(self, response: dict[str, Any], prior: Stored | None, items: list[dict[str, Any]]) -> bool:
        """Keep a response, whose conversation is `prior`'s (the response its previous_response_id named) and then
        `items` (its input and output), False when it alone is larger than the byte cap (not kept). Only what is
        new is serialized to count its bytes: a long conversation's turns each cost their own size."""
        conversation_bytes = len(json.dumps(items)) + (prior.conversation_bytes if prior else 0)
        size = len(json.dumps(response)) + conversation_bytes
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        conversation = [*prior.conversation, *items] if prior else items
        self._held[response["id"]] = Stored(response, conversation, conversation_bytes, size)
        self.num_bytes += size
        while len(self._held) > self.max_responses or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._held.popitem(last=False)[1].size
        return True

    def get(self, response_id: str) -> Stored | None:
        stored = self._held.get(response_id)
        if stored is not None:
            self._held.move_to_end(response_id)
        return stored

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        stored = self.get(response_id)
        return None if stored is None else stored.conversation

    def delete(self, response_id: str) -> bool:
        stored = self._held.pop(response_id, None)
        if stored is not None:
            self.num_bytes -= stored.size
        return stored is not None


# ---- the response -------------------------------------------------------------------------------

class Draft:
    """One response being made: its id, the request's echoed fields and what the store keeps of it."""

    def __init__(self, ctx: ServingContext, body: ResponsesRequest, prior: Stored | None):
        self.ctx, self.body, self.prior = ctx, body, prior
        self.id, self.created_at = "resp_" + uuid.uuid4().hex, int(time.time())
        self.encoded = ENCRYPTED_REASONING in (body.include or ())  # reasoning items carry encrypted_content

    def response(self, status: str, output: list[dict[str, Any]], usage: dict | None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.ctx.served_model, "output": output,
                "usage": usage, "instructions": b.instructions, "tools": [_tool(t) for t in b.tools or ()],
                "tool_choice": _tool_choice(b), "parallel_tool_calls": b.parallel_tool_calls,
                "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
                "text": _text(b), "reasoning": _reasoning(b), "metadata": b.metadata or {},
                "previous_response_id": b.previous_response_id, "store": b.store, "user": b.user,
                "truncation": "disabled", "background": False}

    def finish(self, store: ResponseStore, response: dict[str, Any]) -> dict[str, Any]:
        """`response` (finished), kept in `store` when the request asked for it."""
        if self.body.store:
            inputs = [item.model_dump(by_alias=True, exclude_none=True) for item in self.body.items()]
            store.put(response, self.prior, [*inputs, *(_as_input(item) for item in response["output"])])
        return response


def _tool(t: Tool) -> dict[str, Any]:
    if isinstance(t, NamespaceTool):
        return {"type": "namespace", "name": t.name, "description": t.description, "tools": [_tool(f) for f in t.tools]}
    return {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
            "strict": t.strict}


def _tool_choice(b: ResponsesRequest) -> Any:
    if b.tool_choice is None:
        return "auto"
    return b.tool_choice if isinstance(b.tool_choice, str) else {"type": "function", "name": b.tool_choice.name}


def _text(b: ResponsesRequest) -> dict[str, Any]:
    f = b.text.format if b.text is not None and b.text.format is not None else None
    return {"format": f.model_dump(by_alias=True, exclude_none=True) if f else {"type": "text"}}


def _reasoning(b: ResponsesRequest) -> dict[str, Any]:
    r = b.reasoning
    return {"effort": r.effort if r else None, "summary": (r.summary or r.generate_summary) if r else None}


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item a later turn sends (previous_response_id)."""
    return {k: v for k, v in item.items() if k != "status"}


# ---- output items -------------------------------------------------------------------------------

def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str, encoded: bool = False) -> dict[str, Any]:
    """`encoded`: with the text as encrypted_content (include reasoning.encrypted_content; see `request`)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": encode_reasoning(text) if encoded else None, "status": status}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: ParsedToolCall, status: str, body: ResponsesRequest) -> dict[str, Any]:
    """A function_call item; a namespace tool's call (the chat tool `<namespace>.<name>`) carries `namespace`."""
    namespace, name = body.call_name(call.name)
    item = {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "call_id": call.id,
            "name": name, "arguments": call.arguments, "status": status}
    return {**item, "namespace": namespace} if namespace else item


def output_items(message: ChatDelta, status: str, draft: Draft) -> list[dict[str, Any]]:
    """The whole answer's items; the last is `status` (incomplete when the answer was cut), the others completed."""
    items = []
    if message.reasoning:
        items.append(reasoning_item(_item_id("rs"), message.reasoning, "completed", draft.encoded))
    if message.content or not (message.reasoning or message.calls):
        items.append(message_item(_item_id("msg"), message.content, "completed"))
    items += [call_item(c, "completed", draft.body) for c in message.calls]
    items[-1]["status"] = status
    return items


def usage(tokenizer: Tokenizer, out: Completion, reasoning: str) -> dict[str, Any]:
    chat = usage_of(out)
    cached = chat.prompt_tokens_details.cached_tokens  # cairn has no separate cache write (as on /v1/messages)
    return {"input_tokens": chat.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(tokenizer, out.token_ids, reasoning)},
            "total_tokens": chat.total_tokens, "cairn": chat.cairn.model_dump()}


def reasoning_tokens(tokenizer: Tokenizer, token_ids: list[int], reasoning: str) -> int:
    """The output tokens of the thinking: those before `</think>` (after `<think>`, if generated) where the tags
    are tokens of their own, else the thinking text's length in tokens."""
    if not reasoning:
        return 0
    start, end = tokenizer.special_tokens.get(THINK_START), tokenizer.special_tokens.get(THINK_END)
    if end is not None and end in token_ids:
        stop = token_ids.index(end)
        return stop - (token_ids.index(start) + 1 if start in token_ids[:stop] else 0)
    return min(len(token_ids), len(tokenizer.encode(reasoning)))


def status_of(shaper: ChatShaper, out: Completion) -> str:
    return "incomplete" if shaper.finish_reason(out.finish_reason) == "length" else "completed"


# ---- the endpoint -------------------------------------------------------------------------------

async def create(ctx: ServingContext, store: ResponseStore, sub: Submission, plan: ChatPlan, body: ResponsesRequest,
                 prior: Stored | None, request: Request, start_s: float) -> Response:
    """A response prepared by `prepare.prepare_response` (`body` and `prior`: the request, the stored response its
    previous_response_id names), answered whole or streamed."""
    try:
        gen = await start_generation(ctx, sub, start_s)
    except (ChatTemplateError, RequestTooLarge) as e:  # (tokenized here: a small body)
        raise in_responses_names(from_exception(e, "input")) from None
    draft, shaper = Draft(ctx, body, prior), ChatShaper(plan)
    headers = {RESPONSE_ID_HEADER: draft.id}
    if body.stream:
        response = SSEResponse(_events(gen, shaper, draft, store), gen.close)
        response.headers.update(headers)
        return response
    (out,) = await gen.final_outputs(request)
    shaper.feed(out.text, final=True)
    status = status_of(shaper, out)
    response = draft.response(status, output_items(shaper.message, status, draft),
                              usage(ctx.tokenizer, out, shaper.message.reasoning))
    return JSONResponse(draft.finish(store, response), headers=headers)


def retrieve(store: ResponseStore, response_id: str, query: Mapping[str, str]) -> Response:
    """GET /v1/responses/{id}: the stored response whole (its query parameters, stream, include,
    starting_after, are not implemented: a 400 naming the first sent)."""
    for name in query:
        raise APIError(400, f"the query parameter {name} is not supported by this server", param=name,
                       code="unsupported_value")
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response, headers={RESPONSE_ID_HEADER: response_id})


def delete(store: ResponseStore, response_id: str) -> Response:
    if not store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


# ---- the stream ---------------------------------------------------------------------------------

class _ItemStream:
    """Numbers the events, and opens, feeds and closes output items as the kind of text changes."""

    def __init__(self, draft: Draft):
        self.draft, self.encoded = draft, draft.encoded  # (encoded: reasoning items carry encrypted_content)
        self.seq, self.items = 0, []  # the closed items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""

    def event(self, kind: str, **payload) -> str:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _switch(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        events = self.close("completed")
        self.open, self.text = item, ""
        events.append(self.event("response.output_item.added", output_index=len(self.items), item=item))
        if part is not None:
            events.append(self.event("response.content_part.added", **self._at(), content_index=0, part=part))
        return events

    def close(self, status: str) -> list[str]:
        """The events closing the open item (if any), which ends `status`."""
        item, events = self.open, []
        if item is None:
            return []
        if item["type"] == "function_call":
            done = {**item, "status": status}
            events.append(self.event("response.function_call_arguments.done", **self._at(),
                                     arguments=item["arguments"]))
        else:
            done = (reasoning_item(item["id"], self.text, status, self.encoded) if item["type"] == "reasoning"
                    else message_item(item["id"], self.text, status))
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            events.append(self.event(f"response.{kind}.done", **self._at(), content_index=0, text=self.text,
                                     **({"logprobs": []} if kind == "output_text" else {})))
            events.append(self.event("response.content_part.done", **self._at(), content_index=0,
                                     part=done["content"][0]))
        events.append(self.event("response.output_item.done", output_index=len(self.items), item=done))
        self.items.append(done)
        self.open = None
        return events

    def open_message(self) -> list[str]:
        return self._switch({**message_item(_item_id("msg"), "", "in_progress"), "content": []},
                            {"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def pieces(self, d: ChatDelta) -> list[str]:
        events: list[str] = []
        if d.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                item = {**reasoning_item(_item_id("rs"), "", "in_progress"), "content": []}
                events += self._switch(item, {"type": "reasoning_text", "text": ""})
            self.text += d.reasoning
            events.append(self.event("response.reasoning_text.delta", **self._at(), content_index=0,
                                     delta=d.reasoning))
        if d.content:
            if self.open is None or self.open["type"] != "message":
                events += self.open_message()
            self.text += d.content
            events.append(self.event("response.output_text.delta", **self._at(), content_index=0, delta=d.content,
                                     logprobs=[]))
        for c in d.calls:
            events += self._switch({**call_item(c, "in_progress", self.draft.body), "arguments": ""}, None)
            self.open["arguments"] = c.arguments
            events.append(self.event("response.function_call_arguments.delta", **self._at(), delta=c.arguments))
        return events


async def _events(gen: Generation, shaper: ChatShaper, draft: Draft, store: ResponseStore) -> AsyncIterator[str]:
    items = _ItemStream(draft)
    yield items.event("response.created", response=draft.response("in_progress", [], None))
    yield items.event("response.in_progress", response=draft.response("in_progress", [], None))
    try:
        async for out in gen.outputs():
            pieces = items.pieces(shaper.feed(out.delta_text, final=out.finished))
            if out.finished:
                answer = gen.answer(out.index)
                status = status_of(shaper, answer)
                if items.open is None and not items.items:  # an empty answer still has one (empty) message
                    pieces += items.open_message()
                pieces += items.close(status)
                body = draft.finish(store, draft.response(status, items.items,
                                                          usage(gen.ctx.tokenizer, answer, shaper.message.reasoning)))
                pieces.append(items.event(f"response.{status}", response=body))
            for piece in pieces:
                yield piece
    except Exception as e:
        error = from_exception(e)
        yield items.event("error", code=error.code, message=error.message, param=error.param)
