"""Response bodies of the OpenAI API as pydantic models, built from a choice's accumulated answer (Completion).

Shapes follow OpenAI's (chat.completion, chat.completion.chunk, text_completion). cairn adds one
object, `usage.cairn`, reporting what the prefix cache did (see `CairnCacheUsage`). Streamed chunks
are SSE events `data: <json>\n\n`, the stream ending with `data: [DONE]\n\n`.

What this module is not: it does not talk to the engine, and it does not decide errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from cairn.outputs import Completion
from cairn.tokenizer import Tokenizer

DONE_EVENT = "data: [DONE]\n\n"


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

def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]} for these tokens."""
    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = _token_text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=False)):
        alternatives = top[i] if i < len(top) else []
        content.append({**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in alternatives]})
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], text_offset_chars: int) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for these tokens."""
    tokens, offsets, tops = [], [], []
    offset = text_offset_chars
    for i, tid in enumerate(token_ids[: len(logprobs)]):
        text = _token_text(tokenizer, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        tops.append({_token_text(tokenizer, t): v for t, v in (top[i] if i < len(top) else [])})
    return {"tokens": tokens, "token_logprobs": logprobs[: len(tokens)], "top_logprobs": tops,
            "text_offset": offsets}


# ---- whole responses and stream chunks ----------------------------------------------------------

@dataclass(frozen=True)
class ResponseHeader:
    """What every response and chunk of one request repeats."""

    id: str
    created: int  # unix seconds
    model: str

    def model_dump(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}


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
