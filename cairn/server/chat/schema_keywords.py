"""The keywords a JSON Schema that constrains decoding may hold: every one is known, or the request is refused.

llguidance enforces the keywords it implements and refuses the JSON Schema keywords it does not (`uniqueItems`,
`not`, ...), but passes over a key that is no JSON Schema keyword at all: a misspelled `maximun` or
`maxLenght` left the value unbounded while the request succeeded. `refuse_unknown_keywords` walks a schema that
will be enforced (a `json_schema` response_format, the parameters of a forced or strict tool) and refuses the
first key that is neither a keyword of JSON Schema (draft 2020-12, with draft 7's `definitions`,
`dependencies` and `additionalItems`), an annotation, nor an `x-` extension, with a 400 naming its path.
Whether llguidance can enforce a known keyword stays its own check.

It then measures how deep the schema nests with its `$ref`s followed, and refuses one deeper than
MAX_SCHEMA_DEPTH (or a `$ref` that points nowhere in it): llguidance compiles a schema by native recursion
on the engine thread, with no depth limit of its own past the nesting of the JSON text, so a chain of a
thousand `$defs` each referring to the next (150 KB) overflowed its stack and killed the server. A `$ref`
back to a schema it is inside of is recursion the grammar keeps (a tree), not depth; every other one is
followed, through JSON pointers, `$anchor`s and `$id`s (where a `$ref` could be read against two bases,
the deeper reading counts). What this is not: a schema validator.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

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
REFS = ("$ref", "$dynamicRef", "$recursiveRef")
ANCHORS = ("$anchor", "$dynamicAnchor")
MAX_SCHEMA_DEPTH = 128  # nested subschemas, $refs followed (llguidance's stack overflowed near 1,000 on 8 MiB)
MAX_SCHEMA_WALK = 200_000  # subschemas visited while measuring a schema's depth


def refuse_unknown_keywords(schema: Any, param: str) -> None:
    """A 400 naming the first key of `schema` (at `param`, the request's path to it) that no JSON Schema
    keyword, annotation or `x-` extension is; subschemas are walked, values (`enum`, `default`, ...) are not.
    Then a 400 for a schema nested deeper than MAX_SCHEMA_DEPTH with its `$ref`s followed (see above)."""
    _refuse_unknown_keywords(schema, param)
    _SchemaDepth(schema, param).check()


def _refuse_unknown_keywords(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = f"{param}.{key}"
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _refuse_unknown_keywords(sub, f"{where}.{name}")
        elif key in SCHEMA_LISTS | SCHEMAS and isinstance(value, list):  # (draft 7's items: a list of schemas)
            for i, sub in enumerate(value):
                _refuse_unknown_keywords(sub, f"{where}.{i}")
        elif key in SCHEMAS:
            _refuse_unknown_keywords(value, where)
        elif key not in VALUES and not key.startswith("x-"):
            hint = " (for a nullable value, add \"null\" to its type)" if key == "nullable" else ""
            raise APIError(400, f"{where}: {key!r} is not a JSON Schema keyword{hint}; a constraining schema may hold "
                                "only JSON Schema keywords, annotations and x- extensions (never ignored)",
                           param=where, code="invalid_value")


def _subschemas(schema: dict) -> list[Any]:
    """The subschemas written inside `schema` (as `_refuse_unknown_keywords` walks them)."""
    subs: list[Any] = []
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            subs += value.values()
        elif key in SCHEMA_LISTS | SCHEMAS and isinstance(value, list):
            subs += value
        elif key in SCHEMAS:
            subs.append(value)
    return subs


class _SchemaDepth:
    """How deep a schema nests with its $refs followed (see the module docstring), refused past the limit."""

    def __init__(self, root: Any, param: str):
        self.root, self.param = root, param
        self.resources: dict[str, list[Any]] = {}  # base URI -> the schemas with that $id ("" : the root)
        self.anchors: dict[tuple[str, str], list[Any]] = {}  # (base URI, anchor) -> schemas
        self.bases: dict[int, tuple[str, str]] = {}  # id(schema) -> (base URI around it, its own base)
        self.depths: dict[int, int] = {}  # id(schema) -> its depth, when no recursion cut it short
        self.visits = 0

    def check(self) -> None:
        if not isinstance(self.root, dict):
            return
        self._register(self.root, "")
        self.resources.setdefault("", []).append(self.root)
        self._depth(self.root, 1, set())

    def _refuse(self, message: str) -> None:
        raise APIError(400, f"{self.param}: {message}", param=self.param, code="invalid_value")

    def _register(self, root: dict, root_base: str) -> None:
        """Record every schema's base URI, and the $ids and anchors $refs may name (iteratively: a deep
        schema must not exhaust Python's stack either)."""
        stack = [(root, root_base)]
        while stack:
            schema, outer = stack.pop()
            if not isinstance(schema, dict) or id(schema) in self.bases:
                continue
            own = outer
            given = schema.get("$id")
            if isinstance(given, str):
                if given.startswith("#"):  # (draft 7: an anchor)
                    self.anchors.setdefault((outer, unquote(given[1:])), []).append(schema)
                else:
                    own = _join(outer, given)
                    self.resources.setdefault(own, []).append(schema)
            for key in ANCHORS:
                if isinstance(schema.get(key), str):
                    for base in {outer, own}:
                        self.anchors.setdefault((base, schema[key]), []).append(schema)
            self.bases[id(schema)] = (outer, own)
            stack += [(sub, own) for sub in _subschemas(schema)]

    def _targets(self, schema: dict, ref: str) -> list[Any]:
        """What `ref` (in `schema`) may point to: read against the base around `schema` and its own."""
        outer, own = self.bases.get(id(schema), ("", ""))
        found = []
        for base in {outer, own}:
            uri, fragment = urldefrag(_join(base, ref))
            fragment = unquote(fragment)
            for doc in self.resources.get(uri, ()):
                if not fragment:
                    found.append(doc)
                elif fragment.startswith("/"):
                    target = _pointer(doc, fragment)
                    if target is not None:
                        self._register(target, uri)  # (a value outside the subschemas: its $refs read against uri)
                        found.append(target)
            if fragment and not fragment.startswith("/"):
                found += self.anchors.get((uri, fragment), ())
        return found

    def _depth(self, schema: Any, level: int, path: set[int]) -> tuple[int, bool]:
        """(how deep `schema` nests, whether a $ref back into `path` cut it short), refusing past the limit."""
        if level > MAX_SCHEMA_DEPTH:
            self._refuse(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} subschemas with its $refs followed")
        self.visits += 1
        if self.visits > MAX_SCHEMA_WALK:
            self._refuse(f"the schema is too complex: more than {MAX_SCHEMA_WALK} subschemas with its $refs followed")
        if not isinstance(schema, dict):
            return 1, False
        if id(schema) in self.depths:
            return self.depths[id(schema)], False
        path.add(id(schema))
        deepest, cut = 0, False
        subs = _subschemas(schema)
        for key in REFS:
            ref = schema.get(key)
            if isinstance(ref, str):
                targets = self._targets(schema, ref)
                if not targets:
                    self._refuse(f"{key} {ref!r} does not point into the schema")
                subs += targets
        for sub in subs:
            if isinstance(sub, dict) and id(sub) in path:
                cut = True  # recursion: the grammar refers back to a rule being defined
                continue
            depth, sub_cut = self._depth(sub, level + 1, path)
            deepest, cut = max(deepest, depth), cut or sub_cut
        path.discard(id(schema))
        if not cut:
            self.depths[id(schema)] = deepest + 1
        return deepest + 1, cut


def _join(base: str, ref: str) -> str:
    """`ref` read against `base` (a fragment alone stays in `base`, whatever its scheme)."""
    if ref.startswith("#"):
        return base + ref
    return urljoin(base, ref) if base else ref


def _pointer(doc: Any, pointer: str) -> Any:
    """The value a JSON pointer ("/a/0/b") names inside `doc`, or None."""
    node = doc
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
