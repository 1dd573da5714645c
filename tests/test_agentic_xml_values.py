"""XML-style forced calls hold every value to its JSON schema, or the request is refused naming the
keyword: raw string values follow `pattern` and `format` (cairn.server.chat.string_regex), the others
(numbers' bounds, nested objects and arrays, enums) follow their sub-schemas through llguidance, and
a keyword nothing enforces is a SamplingError (a 400), never ignored.

The grammar is driven token by token with random logits through its mask (tests.test_agentic_grammar.
drive), so whatever comes out is what the grammar allows; each value is then checked by independent
code: Python's `re` for patterns, the standard library's parsers for formats, jsonschema for the rest.
The last tests do the same against a real `cairn serve` through the official openai client.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import string
import urllib.parse
import uuid

import idna
import jsonschema
import openai
import pytest

from cairn.errors import SamplingError
from cairn.request.grammar import allowed_masks
from cairn.request.tokenizer import ByteTokenizer
from cairn.server.chat.parsers import ToolCallParser, parse_call
from cairn.server.chat.string_regex import FORMATS, pattern_regex
from tests.server_process import served_fixture
from tests.test_agentic_grammar import VOCAB, compile_calls, drive

DURATION = re.compile(r"P(?:(\d+)Y)?(?:(\d+)M)?(?:(\d+)W)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?")


def valid_duration(text: str) -> bool:
    m = DURATION.fullmatch(text)
    return bool(m and any(m.groups()) and (not text.count("T") or any(m.groups()[4:]))
                and not (m.group(3) and any(g for i, g in enumerate(m.groups()) if i != 2)))


def valid_email(text: str) -> bool:
    local, _, domain = text.rpartition("@")
    return bool(local) and not local.startswith(".") and ".." not in local and bool(idna.encode(domain))


CHECKS = {  # format -> an independent check of a value
    "date": datetime.date.fromisoformat,
    "time": lambda v: datetime.time.fromisoformat(v.upper()).tzinfo is not None,  # RFC 3339 allows a z
    "date-time": lambda v: datetime.datetime.fromisoformat(v.upper()).tzinfo is not None and v[10] in "Tt",
    "duration": valid_duration,
    "email": valid_email,
    "hostname": lambda v: idna.encode(v, uts46=True),
    "ipv4": ipaddress.IPv4Address,
    "ipv6": ipaddress.IPv6Address,
    "uuid": lambda v: str(uuid.UUID(v)) == v.lower(),
    "uri": lambda v: valid_uri(v),
}


def valid_uri(text: str) -> bool:
    parts = urllib.parse.urlsplit(text)
    parts.port  # noqa: B018 (raises ValueError on a port that is not a number)
    allowed = set("-._~!$&'()*+,;=:@/?#%") | set(string.ascii_letters + string.digits)
    return bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", parts.scheme)) and set(text) <= allowed \
        and text.count("#") <= 1 and all(re.fullmatch("[0-9A-Fa-f]{2}", p[:2]) for p in text.split("%")[1:])
PATTERNS = ["^[0-9]{3}-[0-9]{4}$", "ab", r"^\d+x|y\w$", "^(cat|dog)s?$", r"^https?://[a-z]+\.com/", "^.{2}$",
            r"^[&~][\d_].$"]


def schema_of(value: dict, **top) -> dict:
    return {"type": "object", "properties": {"v": value}, "required": ["v"], **top}


def one_call(tok, tools: dict, seed: int, fmt: str = "xml") -> dict:
    grammar = compile_calls(tok, fmt, parallel=False, tools=tools)
    text = tok.decode(drive(tok, grammar, seed, most=2000))
    assert grammar.done, text
    parser = ToolCallParser(tools)
    calls = parser.feed(text)[1] + parser.finish()[1]
    assert len(calls) == 1, text
    return json.loads(calls[0].arguments)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_xml_string_values_follow_their_format(name):
    tok = ByteTokenizer()
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": name, "maxLength": 40}},
              "required": ["v"], "additionalProperties": False}
    for seed in range(6):
        value = one_call(tok, {"f": schema}, seed)["v"]
        assert CHECKS[name](value), value


@pytest.mark.parametrize("pattern", PATTERNS)
def test_xml_string_values_match_their_pattern_searched_as_json_schema_says(pattern):
    tok = ByteTokenizer()
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern, "maxLength": 24}},
              "required": ["v"], "additionalProperties": False}
    for seed in range(6):
        value = one_call(tok, {"f": schema}, seed)["v"]
        assert re.search(pattern, value) and len(value) <= 24, value


def test_pattern_regex_anchors_each_alternative_on_its_own():
    regex = re.compile(pattern_regex(r"^a|b$").replace("(?s:.*)", "[\\s\\S]*"))
    assert [bool(regex.fullmatch(s)) for s in ("ax", "xb", "xa", "bx")] == [True, True, False, False]


def test_a_raw_value_the_pattern_forbids_is_masked():
    tok = ByteTokenizer()
    schema = {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
              "required": ["phone"]}
    grammar = compile_calls(tok, "xml", parallel=False, tools={"f": schema})
    start = tok.encode("<tool_call>\n<function=f>\n<parameter=phone>\n12")
    drive(tok, grammar, 0, prefix=start, most=len(start))
    allowed = {tok.decode([t]) for t in allowed_masks([grammar], VOCAB)[0].nonzero().flatten().tolist()}
    assert allowed == set("0123456789")


NESTED = {"type": "object", "properties": {
    "where": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                              "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
              "required": ["lat", "tag"], "additionalProperties": False},
    "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "minItems": 1,
              "maxItems": 3},
    "level": {"type": "integer", "minimum": 3, "maximum": 5, "multipleOf": 2},
    "mode": {"enum": ["fast", "slow"]}, "name": {"type": "string", "minLength": 2, "maxLength": 5}},
    "required": ["where", "hours", "level", "mode", "name"], "additionalProperties": False}


def test_xml_values_that_are_not_raw_text_follow_their_sub_schemas():
    tok = ByteTokenizer()
    for seed in range(6):
        args = one_call(tok, {"f": NESTED}, seed)
        jsonschema.validate(args, NESTED)
        assert re.search("^[a-z]{1,4}$", args["where"]["tag"]) and args["level"] == 4


def test_xml_enum_values_are_exact_and_held_to_the_other_keywords():
    """An enum's strings are written raw and exactly (regex syntax in them is literal); its pattern and
    length bounds still apply, so only the strings that pass them can come out."""
    tok = ByteTokenizer()
    value = {"type": "string", "enum": ["a.b", "x/y", "1+1", "(c)", "zz[", "long one"], "pattern": "^[^z]",
             "maxLength": 3}
    seen = {one_call(tok, {"f": schema_of(value)}, seed)["v"] for seed in range(24)}
    assert seen <= {"a.b", "x/y", "1+1", "(c)"} and len(seen) > 1, seen


@pytest.mark.parametrize("extra,check", [(False, lambda args: args == {}),
                                         ({"type": "integer", "minimum": 0, "maximum": 9},
                                          lambda args: all(isinstance(v, int) and 0 <= v <= 9 for v in args.values()))])
def test_parameters_without_properties_follow_additional_properties(extra, check):
    tok = ByteTokenizer()
    schema = {"type": "object", "additionalProperties": extra}
    for seed in range(4):
        args = one_call(tok, {"f": schema}, seed)
        assert check(args) and len(args) < 8, args


def test_values_of_parameters_outside_properties_are_read_by_additional_properties():
    schema = {"type": "object", "additionalProperties": {"type": "string"}}
    call = parse_call("<function=f>\n<parameter=zip>\n75001\n</parameter>\n</function>", {"f": schema}, True)
    assert json.loads(call.arguments) == {"zip": "75001"}  # text, as the schema says (not the number 75001)


def refusal(tools: dict, fmt: str = "xml") -> str:
    with pytest.raises(SamplingError) as info:
        compile_calls(ByteTokenizer(), fmt, parallel=False, tools=tools)
    message = str(info.value)
    assert message.split(" ", 1)[0] == "tools", message  # the 400's param
    return message


@pytest.mark.parametrize("fmt", ["xml", "json"])
def test_unknown_format_is_refused_naming_it(fmt):
    assert "no-such-format" in refusal({"f": schema_of({"type": "string", "format": "no-such-format"})}, fmt)


@pytest.mark.parametrize("schema,keyword", [
    (schema_of({"type": "string", "not": {"const": "x"}}), "not"),
    (schema_of({"type": "string", "enum": ["x", "y"], "not": {"const": "x"}}), "not"),
    (schema_of({"type": "string", "anyOf": [{"format": "date"}, {"format": "uri"}]}), "anyOf"),
    (schema_of({"type": "string"}, minProperties=1), "minProperties"),
    (schema_of({"type": "string"}, oneOf=[{"required": ["v"]}]), "oneOf"),
    (schema_of({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (schema_of({"type": "string", "pattern": "(?=a)b"}), "look-around"),
])
def test_xml_keywords_nothing_enforces_are_refused_naming_them(schema, keyword):
    assert keyword in refusal({"f": schema})


def test_json_style_keywords_llguidance_cannot_enforce_are_refused_naming_them():
    assert "uniqueItems" in refusal({"f": schema_of({"type": "array", "uniqueItems": True})}, "json")


@pytest.mark.parametrize("fmt", ["xml", "json"])
def test_annotations_and_extensions_do_not_refuse_the_call(fmt):
    """Agents' tool schemas carry $schema, titles, defaults, examples and x- extensions: all annotations."""
    tok = ByteTokenizer()
    value = {"type": "string", "title": "When", "description": "a day", "default": "2024-01-01",
             "examples": ["2024-01-02"], "format": "date", "x-origin": "mcp"}
    schema = {**schema_of(value), "$schema": "http://json-schema.org/draft-07/schema#", "title": "f",
              "additionalProperties": False}
    assert datetime.date.fromisoformat(one_call(tok, {"f": schema}, 0, fmt)["v"])


# ---- served: the demo model's template writes XML-style calls --------------------------------------

BOOKING = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                     "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                     "seats": {"type": "integer", "minimum": 1, "maximum": 4}},
    "required": ["day", "code", "seats"], "additionalProperties": False}}}


served = served_fixture("--max-model-len", "2048", "--max-num-seqs", "2", "--log-level", "WARNING")


@pytest.mark.parametrize("stream", [False, True])
def test_served_xml_call_values_follow_pattern_and_format(client, stream):
    ask = dict(model="cairn-demo-random", messages=[{"role": "user", "content": "Book it."}], tools=[BOOKING],
               tool_choice={"type": "function", "function": {"name": "book"}}, temperature=1.0, max_tokens=300)
    for seed in range(2):
        if stream:
            with client.chat.completions.stream(**ask, seed=seed) as s:
                choice = s.get_final_completion().choices[0]
        else:
            choice = client.chat.completions.create(**ask, seed=seed).choices[0]
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert choice.finish_reason == "tool_calls" and call.function.name == "book"
        jsonschema.validate(args, BOOKING["function"]["parameters"])
        assert datetime.date.fromisoformat(args["day"]) and re.search("^[A-Z]{2}[0-9]{2}$", args["code"])


def test_served_unenforceable_keyword_is_a_400_naming_it(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": schema_of(
        {"type": "string", "format": "no-such-format"})}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="cairn-demo-random", messages=[{"role": "user", "content": "Go."}],
                                       tools=[tool], tool_choice="required", max_tokens=20)
    error = info.value.body
    assert error["param"] == "tools" and "no-such-format" in error["message"], error


def test_pattern_ending_in_an_escaped_dollar_is_not_anchored_at_the_end():
    """`\\$` at the end is a literal dollar sign, not the end anchor; `\\\\$` is a backslash, then the anchor."""
    literal = re.compile(pattern_regex(r"^[0-9]+\$").replace("(?s:.*)", "[\\s\\S]*"))
    assert [bool(literal.fullmatch(s)) for s in ("12$", "12$ more", "12")] == [True, True, False]
    anchored = re.compile(pattern_regex(r"^[0-9]+\\$").replace("(?s:.*)", "[\\s\\S]*"))
    assert [bool(anchored.fullmatch(s)) for s in ("12\\", "12\\ more")] == [True, False]
