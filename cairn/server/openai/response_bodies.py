"""Response bodies of the OpenAI API as pydantic models, built from a choice's accumulated answer (Completion).

Shapes follow OpenAI's (chat.completion, chat.completion.chunk, text_completion). cairn adds one
object, `usage.cairn`, reporting what the prefix cache did (see `CairnCacheUsage`). Streamed chunks
are SSE events `data: <json>\n\n`, the stream ending with `data: [DONE]\n\n`.

What this module is not: it does not talk to the engine, and it does not decide errors.
"""

from __future__ import annotations

import codecs
import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from cairn.engine.outputs import Completion
from cairn.request.tokenizer import Tokenizer

if TYPE_CHECKING:
    from cairn.server.serving import ResponseHeader  # (what every body and chunk repeats)

DONE_EVENT = "data: [DONE]\n\n"


def model_list(cards: list[dict]) -> dict:
    """GET /v1/models: OpenAI's list of model cards, with Anthropic's page fields (one page, all of them)."""
    return {"object": "list", "data": cards, "has_more": False, "first_id": cards[0]["id"] if cards else None,
            "last_id": cards[-1]["id"] if cards else None}


class CairnCacheUsage(BaseModel):
    """What the prefix cache did for this request (Completion.cache)."""

    resume_position: int  # prompt position the request resumed at; 0 = cold prefill
    tier: str | None  # tier the resumed snapshot came from (device, host, disk)
    source: str | None  # placement rule that made that snapshot (grid, message, prompt_end, ...)
    miss_reason: str | None  # why no deeper resume point was usable
    match_length: int  # longest common prefix with any cached path, in tokens
    snapshots_taken: int  # snapshots this request added to the cache


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens resumed from the cache instead of computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    cairn: CairnCacheUsage


def usage_of(out: Completion) -> Usage:
    c = out.cache
    completion = len(out.token_ids)
    return Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=completion,
                 total_tokens=out.num_prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=c.cached_tokens),
                 cairn=CairnCacheUsage(resume_position=c.resume_position, tier=c.resume_tier, source=c.resume_source,
                                       miss_reason=c.miss_reason, match_length=c.match_length,
                                       snapshots_taken=c.snapshots_taken))


# ---- logprobs -----------------------------------------------------------------------------------

def token_text(raw: bytes) -> str:
    """A token's text as logprobs report it: its bytes as UTF-8 or, when they are not whole characters (a
    byte-level token holding part of one), `bytes:` and the bytes escaped (`bytes:\\xc3`), the notation
    OpenAI's API uses, so that two such tokens keep different texts (the `bytes` field has them raw)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each token of one answer starts in its text, in characters: the length of the text the
    tokens before it decode to (incremental UTF-8 decoding, as the answer's text is made), so a token
    that ends a character starts where that character does and the next starts after it:

        tokens    "   c3  a9  e2  82  ac  "          (the answer "é€", as byte tokens)
        offsets   0   1   1   2   2   2   3

    One per answer, fed its tokens in order (a stream's chunks one after the other). A token whose text
    the answer leaves out (`hidden`: special tokens, with skip_special_tokens) takes no room in it."""

    def __init__(self, hidden: frozenset[int] = frozenset()):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = 0
        self.hidden = hidden

    def next_start(self, raw: bytes, token_id: int | None = None) -> int:
        """The offset of the next token, whose bytes are `raw`; then counts them in (unless it is hidden)."""
        start = self.num_chars
        if token_id not in self.hidden:
            self.num_chars += len(self._utf8.decode(raw))
        return start


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]} for these tokens."""
    def entry(tid: int, lp: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(tid)
        return {"token": token_text(raw), "logprob": lp, "bytes": list(raw)}

    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=False)):
        alternatives = top[i] if i < len(top) else []
        content.append({**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in alternatives]})
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], offsets: TextOffsets) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for these tokens, the next ones of the
    answer `offsets` follows."""
    tokens, starts, tops = [], [], []
    for i, tid in enumerate(token_ids[: len(logprobs)]):
        raw = tokenizer.token_bytes(tid)
        tokens.append(token_text(raw))
        starts.append(offsets.next_start(raw, tid))
        tops.append(_top_by_text(tokenizer, top[i] if i < len(top) else []))
    return {"tokens": tokens, "token_logprobs": logprobs[: len(tokens)], "top_logprobs": tops,
            "text_offset": starts}


def _top_by_text(tokenizer: Tokenizer, alternatives: list[tuple[int, float]]) -> dict[str, float]:
    """{token text: logprob} of one position's alternatives (likeliest first). Two tokens may share a text
    (an added token and the vocabulary piece it repeats): the later one is keyed `token_id:<id>`, vLLM's
    notation for a token given by id, so that no alternative is lost."""
    out: dict[str, float] = {}
    for tid, lp in alternatives:
        text = token_text(tokenizer.token_bytes(tid))
        out[f"token_id:{tid}" if text in out else text] = lp
    return out


# ---- whole responses and stream chunks ----------------------------------------------------------

def chat_response(h: ResponseHeader, out: Completion, message: dict[str, Any], finish_reason: str | None,
                  logprobs: dict | None, token_ids: bool = False) -> dict[str, Any]:
    """A whole chat.completion; `token_ids`: add the output's (choice) and the prompt's token ids."""
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    body = {**h.model_dump(), "object": "chat.completion", "choices": [choice], "usage": usage_of(out).model_dump()}
    if token_ids:
        choice["token_ids"] = list(out.token_ids)
        body["prompt_token_ids"] = out.prompt_token_ids
    return body


def completion_response(h: ResponseHeader, out: Completion, logprobs: dict | None,
                        token_ids: bool = False) -> dict[str, Any]:
    """A whole text_completion; `token_ids`: add the output's and the prompt's token ids to the choice (as
    vLLM does, and as each choice's last chunk does when streamed)."""
    choice = {"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}
    if token_ids:
        choice["token_ids"] = list(out.token_ids)
        choice["prompt_token_ids"] = out.prompt_token_ids
    return {**h.model_dump(), "object": "text_completion", "choices": [choice], "usage": usage_of(out).model_dump()}


def chat_chunk(h: ResponseHeader, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: dict | None = None, **choice_extra) -> dict[str, Any]:
    """One chat.completion.chunk; `choice_extra` (token_ids) goes into the choice."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **choice_extra}
    return {**h.model_dump(), "object": "chat.completion.chunk", "choices": [choice]}


def completion_chunk(h: ResponseHeader, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None, **choice_extra) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, **choice_extra}
    return {**h.model_dump(), "object": "text_completion", "choices": [choice]}


def usage_chunk(h: ResponseHeader, obj: str, out: Completion) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {**h.model_dump(), "object": obj, "choices": [], "usage": usage_of(out).model_dump()}


# ---- SSE events and the choices of an n > 1 request ---------------------------------------------

def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def with_choices(bodies: list[dict], outs: list[Completion]) -> dict:
    """One response holding every choice of an n > 1 request: each body's choice with its index, the
    usage counting every choice's tokens (the prompt once)."""
    body = bodies[0]
    body["choices"] = [{**b["choices"][0], "index": out.index} for b, out in zip(bodies, outs, strict=True)]
    if body.get("usage"):
        _count_all_choices(body["usage"], outs)
    return body


def _count_all_choices(usage: dict, outs: list[Completion]) -> None:
    usage["completion_tokens"] = sum(len(o.token_ids) for o in outs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def indexed(chunk: dict, index: int) -> dict:
    """A one-choice stream chunk for choice `index` of the request."""
    chunk["choices"][0]["index"] = index
    return chunk


def choices_usage_chunk(header: ResponseHeader, obj: str, finals: list[Completion]) -> dict:
    """The usage chunk of an n > 1 stream: every choice's tokens (the prompt once)."""
    chunk = usage_chunk(header, obj, finals[0])
    _count_all_choices(chunk["usage"], finals)
    return chunk
