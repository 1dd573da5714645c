"""The keywords a JSON Schema that constrains decoding may hold: every one is known, or the request is refused.

llguidance enforces the keywords it implements and refuses the JSON Schema keywords it does not (`uniqueItems`,
`not`, ...), but passes over a key that is no JSON Schema keyword at all: a misspelled `maximun` or
`maxLenght` left the value unbounded while the request succeeded. `refuse_unknown_keywords` walks a schema that
will be enforced (a `json_schema` response_format, the parameters of a forced or strict tool) and refuses the
first key that is neither a keyword of JSON Schema (draft 2020-12, with draft 7's `definitions`,
`dependencies` and `additionalItems`), an annotation, nor an `x-` extension, with a 400 naming its path.
Whether llguidance can enforce a known keyword stays its own check. What this is not: a schema validator.
"""

from __future__ import annotations

from typing import Any

from cairn.server.errors import APIError

SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
SCHEMAS = frozenset({"items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
                     "not", "if", "then", "else", "contains", "propertyNames", "contentSchema"})
VALUES = frozenset({
    "type", "enum", "const", "required", "dependentRequired", "dependencies",
    "minItems", "maxItems", "uniqueItems", "minContains", "maxContains", "minProperties", "maxProperties",
    "minLength", "maxLength", "pattern", "format", "contentEncoding", "contentMediaType",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "$ref", "$dynamicRef", "$recursiveRef", "$id", "$schema", "$anchor", "$dynamicAnchor", "$recursiveAnchor",
    "$vocabulary", "$comment",
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",  # annotations
})


def refuse_unknown_keywords(schema: Any, param: str) -> None:
    """A 400 naming the first key of `schema` (at `param`, the request's path to it) that no JSON Schema
    keyword, annotation or `x-` extension is; subschemas are walked, values (`enum`, `default`, ...) are not."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = f"{param}.{key}"
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                refuse_unknown_keywords(sub, f"{where}.{name}")
        elif key in SCHEMA_LISTS | SCHEMAS and isinstance(value, list):  # (draft 7's items: a list of schemas)
            for i, sub in enumerate(value):
                refuse_unknown_keywords(sub, f"{where}.{i}")
        elif key in SCHEMAS:
            refuse_unknown_keywords(value, where)
        elif key not in VALUES and not key.startswith("x-"):
            hint = " (for a nullable value, add \"null\" to its type)" if key == "nullable" else ""
            raise APIError(400, f"{where}: {key!r} is not a JSON Schema keyword{hint}; a constraining schema may hold "
                                "only JSON Schema keywords, annotations and x- extensions (never ignored)",
                           param=where, code="invalid_value")
