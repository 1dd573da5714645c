"""OpenAI-shaped errors: one exception type for the HTTP layer and the mapping from engine errors to it.

Every error the server returns has the body

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

with the status codes below, but on /v1/messages (Anthropic's API), whose errors, the middlewares' 401,
413 and 408 included, have Anthropic's body {"type": "error", "error": {"type": str, "message": str}}
with the type of ANTHROPIC_TYPES (`APIError.body_for`). This module decides status, type and code; it
does not log and does not know about requests in flight. The engine's errors it maps come from
cairn.errors, the only part of cairn it imports.

| raised by                                    | status | type                  | code                    |
|----------------------------------------------|--------|-----------------------|-------------------------|
| malformed JSON                               | 400    | invalid_request_error | invalid_json            |
| a missing field / a wrong type or value      | 400    | invalid_request_error | missing_field / invalid_value |
| a field the server does not know             | 400    | invalid_request_error | unknown_field           |
| SamplingError, ChatTemplateError, ValueError | 400    | invalid_request_error | invalid_value           |
| an unsupported option (n > 1, echo, ...)     | 400    | invalid_request_error | unsupported_value       |
| RequestTooLarge: prompt over the context     | 400    | invalid_request_error | context_length_exceeded |
| RequestTooLarge: other (empty prompt, ...)   | 400    | invalid_request_error | invalid_value           |
| no or a wrong API key (--api-key)            | 401    | invalid_request_error | invalid_api_key         |
| unknown model                                | 404    | invalid_request_error | model_not_found         |
| head or body slower than --*-timeout-s       | 408    | invalid_request_error | request_timeout         |
| body over --max-request-bytes                | 413    | invalid_request_error | request_too_large       |
| a POST body not sent as JSON (Content-Type)  | 415    | invalid_request_error | unsupported_media_type  |
| a Host naming no name of a loopback server   | 421    | invalid_request_error | invalid_host            |
| QueueFull                                    | 429    | rate_limit_error      | queue_full              |
| client closed the connection (not sent)      | 499    | invalid_request_error | client_closed           |
| EngineFailure, any other exception           | 500    | server_error          | internal_error          |
| ServerShuttingDown                           | 503    | server_error          | shutting_down           |
| a connection over --max-connections          | 503    | server_error          | too_many_connections    |
|   (its /health is answered: busy is alive)   |        |                       |                         |
| /ready while not ready (see app)             | 503    | server_error          | not_ready               |
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from cairn.errors import ChatTemplateError, QueueFull, RequestTooLarge, SamplingError

INVALID = "invalid_request_error"
ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class ServerShuttingDown(RuntimeError):
    """The server is draining: it takes no new request, and aborts the ones left at the deadline."""


class EngineFailure(RuntimeError):
    """engine.step() raised while this request was running; the request was aborted."""


@dataclass(eq=False)
class APIError(Exception):
    """An error response: raise it anywhere in a handler and the app turns it into JSON."""

    status: int
    message: str
    type: str = INVALID
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self):
        self.message, self.param = printable(self.message), self.param and printable(self.param)

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"

    def __reduce__(self):
        """Pickled by its fields (a request worker process raises it to the server): an exception pickles its
        `args`, which hold only the positional arguments it was made with, none for one made by keyword
        (`dataclasses.replace`), and unpickling it then failed in the server as a 500."""
        return type(self), (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_TYPES.get(self.status, INVALID if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict:
        """The body in the shape of the API at `path`: Anthropic's on /v1/messages (and below it), else OpenAI's."""
        return self.anthropic_body() if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/") else self.body()

    def body_bytes(self, path: str = "") -> bytes:
        return json.dumps(self.body_for(path)).encode()


def printable(text: str) -> str:
    """`text` with each lone UTF-16 surrogate (JSON's `\\ud800` escape without its pair, in a key or value a
    client sent) written as that escape: UTF-8, the response and the log cannot encode it, and an error naming
    such a field failed while it was rendered (a 500 and a traceback)."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def from_exception(e: BaseException, prompt_param: str = "messages") -> APIError:
    """The response for an exception raised by add_request, SamplingParams or the engine thread.
    `prompt_param` names the prompt field in errors about it ("messages" or "prompt")."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(429, f"The server is busy: {e}", "rate_limit_error", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(e, ServerShuttingDown):
        return APIError(503, str(e) or "The server is shutting down.", "server_error", code="shutting_down")
    if isinstance(e, RequestTooLarge):
        over_context = "context" in str(e)
        return APIError(400, str(e), param="max_tokens" if "max_tokens" in str(e) else prompt_param,
                        code="context_length_exceeded" if over_context else "invalid_value")
    if isinstance(e, SamplingError):
        return APIError(400, str(e), param=str(e).split(" ", 1)[0], code="invalid_value")
    if isinstance(e, ChatTemplateError):
        return APIError(400, str(e), param="messages", code="invalid_value")
    if isinstance(e, ValueError):
        return APIError(400, str(e), code="invalid_value")
    return APIError(500, f"Internal server error: {type(e).__name__}: {e}", "server_error", code="internal_error")


def naming_max_tokens(error: APIError, field: str) -> APIError:
    """`error` naming `field` where it names max_tokens: the output limit under the name the client sent
    it (max_completion_tokens), which SamplingParams and the engine know only as max_tokens."""
    if error.param != "max_tokens" or field == "max_tokens":
        return error
    return dataclasses.replace(error, param=field, message=re.sub(r"\bmax_tokens\b", field, error.message))


def renamed(error: APIError, paths: tuple[tuple[re.Pattern, str], ...]) -> APIError:
    """`error`, raised by an equivalent chat request's checks, naming the fields another API's request sent:
    each (pattern, name) of `paths` substituted in its message and param, in order."""
    def rename(text: str) -> str:
        for pattern, name in paths:
            text = pattern.sub(name, text)
        return text

    return dataclasses.replace(error, message=rename(error.message), param=error.param and rename(error.param))


def from_validation_errors(errors: list[dict]) -> APIError:
    """The response for FastAPI's RequestValidationError (malformed JSON, wrong or missing fields), naming
    the error that says most (see `_telling`)."""
    first = min(errors, key=_telling) if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    loc = _path(first.get("loc", ()))
    param = ".".join(loc) or None
    code = "missing_field" if first.get("type") == "missing" else "invalid_value"
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if first.get("type") == "extra_forbidden":
        code, message = "unknown_field", f"unknown field `{param}`: this server does not implement it"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code=code)


def _telling(error: dict) -> int:
    """How much an error tells the client, least first: a block or tool of a type the server does not
    take (an Anthropic image block, a server tool) says so, before the other members of the union (the
    `str` of `content: str | list[...]`, given a list) and the fields of the type it is not."""
    loc = error.get("loc", ())
    if error.get("type") == "union_tag_invalid" or (error.get("type") == "literal_error" and loc[-1:] == ("type",)):
        return 0
    if error.get("type") == "string_type" and "str" in loc and isinstance(error.get("input"), list | dict):
        return 2
    return 1


def _path(loc: tuple) -> list[str]:
    """The error's location as the client's field path: without `body`, the union members pydantic
    tried, and the tag it read a tagged union's member by (`...content.0.tool_result.content`)."""
    path: list[str] = []
    for i, part in enumerate(loc):
        tag = i >= 2 and isinstance(loc[i - 2], str) and "tagged-union[" in loc[i - 2]
        if part != "body" and not _is_union_tag(part) and not tag:
            path.append(str(part))
    return path


def _is_union_tag(part) -> bool:
    """pydantic names the member of a union it tried (`str`, `list[int]`, `function-after[...]`) in the
    error location; the field's own path is what the client needs."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "dict", "list", "none"} or "[" in part)
