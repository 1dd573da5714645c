"""Grammars that force tool calls (tool_choice `required` or a named function), in the chat template's format.

The grammar is llguidance Lark text whose top rule is `answer` (cairn.grammar wraps it: after the
reasoning, if any). It allows exactly what the template renders for an assistant's calls and what
`parsers.parse_call` reads back, so a forced answer always parses into calls that name one of the
given functions:

    xml   <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
          (Qwen3.5). Parameters come in the order of the schema's `properties`, the required ones
          always, the others optionally; a string parameter's VALUE is raw text (never containing
          `</parameter>`, held to its minLength / maxLength, `pattern` and `format` by
          `string_regex`; an enum or const is one of its strings), any other parameter's VALUE is
          JSON following its sub-schema. A schema without `properties` allows any parameter names,
          with values following `additionalProperties` (text when it is absent or true, none when false).
    json  <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>   (Qwen3 / Qwen3-Next)
          ARGS is JSON following the function's parameters schema.

With `parallel` the answer is one or more calls separated by a newline (as the templates render
them), else exactly one. With `optional` (tool_choice auto, a tool marked `strict`) the answer is
free text in which a `<tool_call>` starts such a call (any number, or with `parallel` false one).
JSON follows the same whitespace rule as response_format (cairn.grammar). What a schema says is
enforced or refused, never ignored: a keyword or format llguidance's `%json` cannot enforce fails to
compile, and an XML-style parameters schema or raw string value may use only the keywords above and
annotations (title, description, ...); either way the request gets a 400 naming the keyword. Only
the call grammar refuses: with tool_choice auto and no `strict` tool, nothing is constrained.

What this is not: the parsing of calls (`parsers`), or compiling the grammar (`cairn.grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cairn.errors import SamplingError
from cairn.request.grammar import WHITESPACE
from cairn.server.chat.parsers import CALL_END, CALL_START
from cairn.server.chat.string_regex import ANNOTATIONS, lark_regex, one_of, string_regexes

CLOSE_PARAMETER = "\n</parameter>\n"
OBJECT_KEYWORDS = {"type", "properties", "required", "additionalProperties", "$defs", "definitions"}


def call_format(template_source: str) -> str:
    """"xml" if the chat template teaches Qwen3.5's `<function=` calls, else "json"."""
    return "xml" if "<function=" in template_source else "json"


def calls_grammar(tools: dict[str, dict], fmt: str, parallel: bool, tag: Callable[[str], str] = json.dumps,
                  optional: bool = False) -> str:
    """Lark rules (top rule `answer`) for one call, or with `parallel` one or more, to the functions in
    `tools` (name -> parameters schema). `tag` writes `<tool_call>` / `</tool_call>` (cairn.grammar.lark_tag:
    a special token where the tokenizer has one). `optional` (tool_choice auto with `strict` tools): any
    text, and whatever follows a `<tool_call>` in it is a call as above. Raises SamplingError (a 400
    naming the keyword) on an XML-style schema it cannot enforce; `%json` parts are checked when compiled."""
    rules: list[str] = []
    functions = [(_function_xml if fmt == "xml" else _function_json)(f"f{i}", name, schema or {}, rules)
                 for i, (name, schema) in enumerate(tools.items())]
    close = r'"</function>\n"' if fmt == "xml" else r'"\n"'
    rules.insert(0, f"call_body: \"\\n\" ({' | '.join(functions)}) {close} {tag(CALL_END)}")
    if optional:
        rules[:0] = _text_and_calls(tag(CALL_START), parallel)
    else:
        rules.insert(0, f"call: {tag(CALL_START)} call_body")
        rules.insert(0, 'answer: call ("\\n" call)*' if parallel else "answer: call")
    return "\n".join(rules) + "\n"


def _text_and_calls(start: str, parallel: bool) -> list[str]:
    """Free text in which each call start opens a constrained call (llguidance's lazy-trigger pattern)."""
    if start.startswith("<["):  # a special token: text never contains it
        head = [f"call_head: TEXT {start}"]
    else:  # text: the head ends at the first call start
        head = ["call_head[lazy]: CALL_HEAD", f"CALL_HEAD: /(?s:.*)/ {start}"]
    calls = "(call_head call_body)*" if parallel else "(call_head call_body)?"
    return [f"answer: {calls} TEXT", "TEXT: /(?s:.*)/", *head]


def _function_json(rule: str, name: str, schema: dict, rules: list[str]) -> str:
    head = json.dumps('{"name": ' + json.dumps(name) + ', "arguments": ')
    rules.append(f"{rule}: {head} {rule}_args \"}}\"")
    rules.append(f"{rule}_args: %json {_json_schema(schema if schema else {'type': 'object'})}")
    return rule


def _function_xml(rule: str, name: str, schema: dict, rules: list[str]) -> str:
    _check_object_keywords(schema, name)
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else None
    required = [r for r in schema.get("required") or () if isinstance(r, str)]
    head = json.dumps(f"<function={name}>" + chr(10))
    if properties is None and not required:  # any parameter names, values following additionalProperties
        extra = schema.get("additionalProperties", True)
        if extra is False:
            rules.append(f"{rule}: {head}")
            return rule
        rules.append(f"{rule}: {head} {rule}_any*")
        rules.append(f'{rule}_any: "<parameter=" /[^<>\\n]+/ ">\\n" {rule}_v')
        where = f"additionalProperties of {name}"
        rules += _value_rules(f"{rule}_v", extra, schema, where) if isinstance(extra, dict) else \
            _text_rules(f"{rule}_v", None, where)
        return rule
    names = list(properties or {}) + [r for r in required if r not in (properties or {})]
    parts = []
    for j, param in enumerate(names):
        sub = f"{rule}_p{j}"
        rules.append(f"{sub}: {json.dumps(f'<parameter={param}>' + chr(10))} {sub}_v")
        rules.extend(_value_rules(f"{sub}_v", (properties or {}).get(param), schema, f"parameter {param} of {name}"))
        parts.append(sub if param in required else f"{sub}?")
    rules.append(f"{rule}: {head} {' '.join(parts)}")
    return rule


def _check_object_keywords(schema: dict, name: str) -> None:
    """The parameters schema of an XML-style function may only use what the grammar above enforces."""
    if schema.get("type", "object") != "object":
        raise SamplingError(f"tools is not usable: the parameters of {name} must be an object schema")
    unknown = sorted(k for k in schema if k not in OBJECT_KEYWORDS | ANNOTATIONS and not k.startswith("x-"))
    if unknown:
        raise SamplingError(f"tools is not usable: the parameters of {name}: the keyword {unknown[0]!r} cannot be "
                            "enforced on XML-style calls; supported: " + ", ".join(sorted(OBJECT_KEYWORDS)))


def _value_rules(rule: str, schema: Any, parent: dict, where: str) -> list[str]:
    """The rules of one XML parameter's value followed by its closing tag."""
    close = json.dumps(CLOSE_PARAMETER)
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    as_text = kind == "string" or (isinstance(kind, list) and "string" in kind)  # what the parser keeps as text
    choices = _string_choices(schema)
    if choices and (as_text or (kind is None and not any(_reads_as_json(c) for c in choices))):
        return _text_rules(rule, schema, where, choices)  # raw, as the template renders
    if as_text:
        return _text_rules(rule, schema, where)
    return [f"{rule}: {rule}_json {close}", f"{rule}_json: %json {_json_schema(_with_defs(schema, parent))}"]


def _string_choices(schema: dict) -> list[str] | None:
    """The strings of an enum or const made only of strings, else None."""
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    return choices if choices and all(isinstance(c, str) for c in choices) else None


def _reads_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _text_rules(rule: str, schema: dict | None, where: str, choices: list[str] | None = None) -> list[str]:
    """A raw text value and its closing tag, as one lazy terminal (it ends at the first closing tag); the
    text never contains `</parameter>`, is one of `choices` (an enum or const) if given, keeps to the
    schema's length bounds and matches its `pattern` and `format` (`string_regex`; a keyword it cannot
    enforce is refused)."""
    schema = schema or {}
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not _is_count(low) or not (high is None or _is_count(high)):
        raise SamplingError(f"tools is not usable: {where}: minLength and maxLength must be non-negative integers")
    length = f"{{{low},{high}}}" if high is not None else f"{{{low},}}"
    operands = [f"/(?s:.{length})/", "~/(?s:.*)<\\/parameter>(?s:.*)/"]
    regexes = string_regexes(schema, where) + ([one_of(choices)] if choices is not None else [])
    operands += [lark_regex(r) for r in regexes]
    terminal = rule.upper()
    return [f"{rule}[lazy]: {terminal}", f"{terminal}: ({' & '.join(operands)}) {json.dumps(CLOSE_PARAMETER)}"]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _with_defs(schema: dict, parent: dict) -> dict:
    """A parameter's sub-schema with the definitions its $refs may point to in the whole schema."""
    defs = {k: parent[k] for k in ("$defs", "definitions") if k in parent and k not in schema}
    return {**schema, **defs}


def _json_schema(schema: dict) -> str:
    """A `%json` body. Strict: a keyword or format llguidance cannot enforce makes the grammar fail to
    compile, a 400 whose message names it (never silently ignored)."""
    return json.dumps({**schema, "x-guidance": {"whitespace_pattern": WHITESPACE}})
