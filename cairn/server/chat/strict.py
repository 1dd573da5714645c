"""What every request body shares: strict types, unknown fields refused, null as the default, known but
unimplemented fields accepted only with their neutral value, and no lone UTF-16 surrogates.

`Strict` is the base model of every request body (the OpenAI ones in `openai.protocol`, Anthropic's in
`anthropic.messages`): `"stream": "yes"`, `"max_tokens": true` or `"prompt": [true]` are refused rather than
coerced, and a field that is not declared is refused with a 400 naming it (`extra="forbid"`). Fields that
cairn knows but does not implement yet are listed once, in `UNIMPLEMENTED_FIELDS`, with the value that
changes nothing: a request may send that value (clients often send `best_of: 1`), any other value is
refused with a 400 naming the field. What this is not: any one API's fields.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cairn.server.errors import APIError

# Known request fields cairn does not implement, each with its neutral value (the one that changes
# nothing, accepted). Implementing a field = declaring it on the request model and removing it here.
UNIMPLEMENTED_FIELDS: dict[str, Any] = {
    "best_of": 1, "echo": False, "suffix": "", "structured_outputs": None, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "guided_decoding_backend": None,
    "functions": None, "function_call": None, "reasoning_effort": None, "prompt_logprobs": None,
    "logprobs_mode": None, "audio": None, "modalities": ["text"], "prediction": None, "web_search_options": None,
}


def refuse_unimplemented(data: Any, where: str = "", fields: dict[str, Any] | None = None) -> Any:
    """Drop known-but-unimplemented fields (`fields`, by default UNIMPLEMENTED_FIELDS) that carry their neutral
    value; refuse any other value."""
    if not isinstance(data, dict):
        return data
    fields = UNIMPLEMENTED_FIELDS if fields is None else fields
    for name in [k for k in data if k in fields]:
        if _is_neutral(data[name], fields[name]):
            del data[name]
            continue
        raise APIError(400, f"{where}{name}={json.dumps(data[name])[:80]} is not supported by this server",
                       param=f"{where}{name}", code="unsupported_value")
    return data


_SURROGATE = re.compile("[\ud800-\udfff]")
_TEXT_OR_NESTED = (str, dict, list)  # what can hold a string: a body's numbers are not looked at one by one
_SCALARS = {int, float, bool, type(None)}


def refuse_lone_surrogates(data: Any) -> Any:
    """Refuse, with a 400 naming the field, a body whose strings (or keys) hold a lone UTF-16 surrogate:
    JSON's `\\ud800` escape without its pair (json joins a pair into one character) reads as a code
    point that is not Unicode text, which no tokenizer (and no UTF-8) can encode. A list of token ids is
    looked over at C speed (60k ids: about 1.5 ms)."""
    stack: list[tuple[tuple, Any]] = [((), data)]  # (path, value) still to look at, the next one last
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            bad = None if value.isascii() else _SURROGATE.search(value)
            if bad:
                where = ".".join(map(str, path))
                raise APIError(400, f"{where or 'the body'} holds a lone UTF-16 surrogate (U+{ord(bad.group()):04X} "
                                    f"at character {bad.start()}), which is not Unicode text",
                               param=where or None, code="invalid_value")
            continue
        if isinstance(value, dict):
            children = [(path + (key,), v) for key, item in value.items() for v in (key, item)
                        if isinstance(v, _TEXT_OR_NESTED)]
        elif isinstance(value, list):
            if set(map(type, value)) <= _SCALARS:  # token ids: one pass at C speed
                continue
            children = [(path + (i,), item) for i, item in enumerate(value) if isinstance(item, _TEXT_OR_NESTED)]
        else:
            continue
        stack += reversed(children)  # (the first field is looked at first: the error names it)
    return data


def _is_neutral(value: Any, neutral: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


class Strict(BaseModel):
    """Strict types, unknown fields refused, and JSON null for a field that has a default means that
    default (clients and wrappers send `"n": null` for a field they leave unset): null is refused only
    for a required field, and any other value is type-checked as strictly as ever."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        return {key: value for key, value in data.items() if value is not None or key not in _optional_keys(cls)}


@functools.cache
def _optional_keys(model: type[BaseModel]) -> frozenset[str]:
    """The keys (aliases where a field has one) of the model's fields that have a default."""
    return frozenset(f.alias or name for name, f in model.model_fields.items() if not f.is_required())


StrictInt = Annotated[int, Field(strict=True)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=1024)]  # vLLM's cache_salt: a tenant's cache namespace
TokenIds = list[Annotated[int, Field(strict=True)]]
