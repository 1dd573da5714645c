"""Refusals a real `cairn serve` answers that no other test drove (issue 11's fifth coverage pass): each
is asked of the served demo model over HTTP and checked as the client sees it (status, the API's error
shape, the field named), and the server keeps serving.

One server (context 1024 tokens) serves the whole module; the demo model's chat template writes
XML-style tool calls, so a tool schema is compiled to the XML call grammar.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api_errors import CHAT, MODEL, assert_error, assert_still_serving, chat
from tests.server_process import served_fixture

served = served_fixture("--max-model-len", "1024", "--log-level", "WARNING")


def test_json_schema_response_format_without_its_schema_is_400(http):
    r = chat(http, response_format={"type": "json_schema"})
    assert_error(r, 400, "invalid_value", "response_format.json_schema")
    assert_still_serving(http)


def test_json_schema_false_is_400_and_true_is_any_json(http):
    """JSON Schema's boolean schemas: `false` accepts nothing (refused), `true` anything (any JSON value)."""
    r = chat(http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": False}})
    assert r.status_code == 400, r.text
    assert "must be a JSON object" in r.json()["error"]["message"]
    r = chat(http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": True}})
    assert r.status_code == 200, r.text


def test_top_logprobs_without_logprobs_is_400(http):
    assert_error(chat(http, top_logprobs=2), 400, "invalid_value", "top_logprobs")


def test_chat_template_kwargs_may_not_set_the_messages(http):
    r = chat(http, chat_template_kwargs={"messages": []})
    assert_error(r, 400, "invalid_value", "chat_template_kwargs.messages")


def test_message_starts_with_a_text_prompt_is_400(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "message_starts": [0], "max_tokens": 1})
    assert_error(r, 400, "invalid_value", "message_starts")


def test_earlier_tool_call_whose_arguments_are_not_json_is_400(http):
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert "tool call arguments must be a JSON object" in r.json()["error"]["message"]


def required_call(http: httpx.Client, parameters: dict) -> httpx.Response:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return chat(http, tools=[tool], tool_choice="required", max_tokens=20)


@pytest.mark.parametrize("parameters,says", [
    ({"type": "array", "items": {"type": "string"}}, "must be an object schema"),
    ({"type": "object", "properties": {"v": {"type": "string", "minLength": -1}}}, "minLength and maxLength"),
    ({"type": "object", "properties": {"v": {"type": "string", "pattern": 5}}}, "'pattern' must be a string"),
])
def test_xml_call_schema_the_grammar_cannot_enforce_is_400_naming_tools(http, parameters, says):
    r = required_call(http, parameters)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and says in error["message"], error
    assert_still_serving(http)


def test_anthropic_user_message_carrying_a_tool_use_block_is_400_in_anthropic_shape(http):
    messages = [{"role": "user", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message":
                                                   "a user message cannot carry tool_use or thinking blocks"}}


def test_anthropic_stream_of_an_empty_answer_still_has_one_text_block(http):
    """A stop sequence that ends the answer at its very start: the stream still opens and closes one
    (empty) text block, as Anthropic's clients expect."""
    ask = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    first = http.post("/v1/messages", json=ask).json()["content"][0]["text"]
    assert first
    with http.stream("POST", "/v1/messages", json={**ask, "stream": True, "stop_sequences": [first]}) as r:
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events == ["message_start", "content_block_start", "content_block_stop", "message_delta",
                      "message_stop"], events


def test_tokenize_without_the_generation_prompt_stops_at_the_last_message(http):
    messages = [{"role": "user", "content": "hello there"}]
    with_prompt = http.post("/tokenize", json={"messages": messages}).json()
    without = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < with_prompt["count"]
    assert without["tokens"] == with_prompt["tokens"][:without["count"]]


def test_tokenize_with_both_prompt_and_messages_is_400(http):
    r = http.post("/tokenize", json={"prompt": "a", "messages": CHAT})
    assert r.status_code == 400 and "exactly one of prompt and messages" in r.text, r.text


@pytest.mark.parametrize("reserved", [{"messages": []}, {"add_generation_prompt": False}, {"tools": []},
                                      {"generation_prefix": "zzz"}, {"cairn_message_mark": "x"}, {"bos_token": "x"},
                                      {"eos_token": "x"}, {"raise_exception": "x"}, {"strftime_now": "x"}])
def test_tokenize_refuses_a_reserved_chat_template_kwarg_as_chat_and_probe_do(http, reserved):
    """chat_template_kwargs may not set what cairn sets itself: the same 400 naming the key on /tokenize as on
    /v1/chat/completions and /v1/cache/probe (it was a 500, or tokens silently altered; the tokenizer's message
    marker was a 500 too, and the special tokens a 400 blaming `messages`)."""
    (key,) = reserved
    for path in ("/tokenize", "/v1/chat/completions", "/v1/cache/probe"):
        r = http.post(path, json={"model": MODEL, "messages": CHAT, "chat_template_kwargs": reserved})
        assert_error(r, 400, "invalid_value", f"chat_template_kwargs.{key}")
    assert_still_serving(http)


def test_tokenize_refuses_empty_messages_as_chat_does(http):
    for path in ("/tokenize", "/v1/chat/completions"):
        assert_error(http.post(path, json={"model": MODEL, "messages": []}), 400, param="messages")


def test_probe_of_a_completion_body_counts_its_prompt_tokens(http):
    ids = http.post("/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    r = http.post("/v1/cache/probe", json={"model": MODEL, "prompt": "hello there"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == len(ids) and r.json()["position"] == 0


@pytest.mark.parametrize("prompt", [[999], [-1], [[65, 1 << 40]]])
def test_probe_of_token_ids_outside_the_vocabulary_is_400_as_the_completion_is(http, prompt):
    for path in ("/v1/completions", "/v1/cache/probe"):
        r = http.post(path, json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert "must be in [0, " in assert_error(r, 400, "invalid_value", "prompt")["message"]
    assert_still_serving(http)


def test_probe_body_that_is_not_json_is_400_invalid_json(http):
    r = http.post("/v1/cache/probe", content=b'{"model": ', headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")


def test_probe_body_with_an_unsupported_field_value_is_400_naming_it(http):
    r = http.post("/v1/cache/probe", json={"model": MODEL, "prompt": "x", "best_of": 3})
    assert_error(r, 400, "unsupported_value", "best_of")
    assert_still_serving(http)


def test_unimplemented_fields_sent_with_their_neutral_value_are_accepted(http):
    """Clients fill in fields cairn does not implement with their defaults (echo false, best_of 1): those
    change nothing and are accepted; any other value is refused naming the field."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1, "echo": False,
                                           "best_of": 1, "suffix": None})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1, "echo": True})
    assert_error(r, 400, "unsupported_value", "echo")


def test_body_that_is_json_but_not_an_object_is_400(http):
    r = http.post("/v1/chat/completions", json=[{"model": MODEL, "messages": CHAT}])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert_still_serving(http)


def test_xml_call_enum_of_strings_that_read_as_json_is_written_as_json(http):
    """An enum without a type whose strings read as JSON ("1", "true"): the parser reads a raw value as
    JSON, so the grammar writes the value as a JSON string and the call's argument is one of the strings."""
    parameters = {"type": "object", "properties": {"v": {"enum": ["1", "true"]}}, "required": ["v"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    r = chat(http, tools=[tool], tool_choice="required", max_tokens=200, temperature=0)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["v"] in ("1", "true")


def test_prompt_too_long_to_fit_whatever_its_tokens_is_refused_before_encoding(http):
    """A text longer than the context's tokens could cover (no token of the demo's byte tokenizer covers
    more than 13 characters: its longest special token) is refused without being tokenized, with the same
    400 as a prompt counted too long."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (13 * 1024 + 1), "max_tokens": 1})
    message = assert_error(r, 400, "context_length_exceeded", "prompt")["message"]
    assert "more than 1024 tokens (13313 characters)" in message and "context is 1024 tokens" in message


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800 lone"}], "max_tokens": 1}',
     "messages.0.content"),
    ("/v1/completions", '{"prompt": "\\ud800 lone", "max_tokens": 1}', "prompt"),
    ("/tokenize", '{"prompt": "\\ud800 lone"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800 lone"}]}', "messages.0.content"),
])
def test_a_lone_surrogate_in_the_text_is_400_naming_its_field(http, path, body, param):
    """The JSON escape of half a UTF-16 pair (sent as written: a JSON encoder refuses to make one) is not
    text the tokenizer can encode: a 400 naming the field, not the codec's message with no field."""
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    error = assert_error(r, 400, "invalid_value", param)
    assert "lone UTF-16 surrogate" in error["message"]
    assert_still_serving(http)


def test_a_lone_surrogate_in_an_anthropic_message_is_400_in_anthropic_shape(http):
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "\ud800"}]})
    r = http.post("/v1/messages", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("messages.0.content holds a lone UTF-16 surrogate")


@pytest.mark.parametrize("constraint,stop,param", [
    ({"tool_choice": "required"}, {"stop": ["</parameter>"]}, "stop"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, {"stop_token_ids": [10]}, "stop_token_ids"),
    ({"response_format": {"type": "json_object"}}, {"stop": "\n"}, "stop"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}}}},
     {"stop_token_ids": [10]}, "stop_token_ids"),
], ids=["required-stop", "named-stop-token", "json-object-stop", "json-schema-stop-token"])
def test_a_stop_with_a_forced_call_or_a_structured_response_format_is_400_naming_it(http, constraint, stop, param):
    """The whole output is constrained, so a stop could only cut it invalid: a forced call cut at "</parameter>"
    came back as finish_reason tool_calls with arguments {} (a required argument missing), a JSON schema cut at a
    newline as '{ "a"' with finish_reason stop. Refused instead."""
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    tools = {"tools": [tool]} if "tool_choice" in constraint else {}
    r = chat(http, **constraint, **tools, **stop, max_tokens=50, temperature=0)
    assert_error(r, 400, "invalid_value", param)
    assert chat(http, **constraint, **tools, max_tokens=50, temperature=0).status_code == 200
    assert_still_serving(http)


def test_a_constraining_schema_with_a_key_that_is_no_json_schema_keyword_is_400_naming_its_path(http):
    """llguidance refuses the keywords it cannot enforce but passed over a key that is no keyword at all: a
    misspelled `maximun` left an integer unbounded ('5777777...') and the request succeeded. A schema that
    constrains decoding (a json_schema response_format, a forced or strict tool) may hold only JSON Schema
    keywords, annotations and x- extensions; a tool that is not enforced goes to the template as sent."""
    def tool(schema: dict, strict: bool = False) -> dict:
        return {"type": "function", "function": {"name": "f", "parameters": schema, "strict": strict}}

    bounded = {"type": "integer", "maximun": 5, "title": "n", "x-vendor": 1}
    r = chat(http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bounded}})
    assert_error(r, 400, "invalid_value", "response_format.json_schema.schema.maximun")
    args = {"type": "object", "properties": {"s": {"type": "string", "maxLenght": 3}}, "required": ["s"]}
    assert_error(chat(http, tools=[tool(args)], tool_choice="required"), 400, "invalid_value",
                 "tools.0.function.parameters.properties.s.maxLenght")
    nullable = {"anyOf": [{"type": "string"}, {"type": "null", "nullable": True}]}
    listed = {"type": "object", "properties": {"s": nullable}}
    assert_error(chat(http, tools=[tool(listed, strict=True)], tool_choice="auto"), 400, "invalid_value",
                 "tools.0.function.parameters.properties.s.anyOf.1.nullable")
    assert chat(http, tools=[tool(args)], tool_choice="auto").status_code == 200  # not enforced: not checked
    known = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9, "title": "N",
                                                    "description": "d", "x-vendor": True}},
             "required": ["n"], "additionalProperties": False, "$defs": {"unused": {"type": "string"}}}
    r = chat(http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": known}},
             max_tokens=30, temperature=0)
    assert r.status_code == 200, r.text
    assert_still_serving(http)


@pytest.mark.parametrize(("fields", "says"), [
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"s": {"maxLenght": 3}}}}],
      "tool_choice": {"type": "any"}}, "tools.0.input_schema.properties.s.maxLenght: "),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "integer", "maximun": 5}}}},
     "output_config.format.schema.maximun: "),
    ({"tools": [{"name": "my tool", "input_schema": {"type": "object"}}]}, "tools.0.name: "),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "", "input": {}}]}]}, "messages.1.content.0.name: "),
])
def test_an_anthropic_refusal_names_the_anthropic_field_not_the_chat_requests(http, fields, says):
    """/v1/messages runs as the equivalent chat request, whose checks named their own fields to an Anthropic
    client (`tools.0.function.parameters...`, `response_format...`), or answered a tool name the chat request
    refuses with pydantic's dump of that internal request ("1 validation error for ChatCompletionRequest...")."""
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **fields}
    counted = {k: v for k, v in body.items() if k != "max_tokens"}
    for path, sent in (("/v1/messages", body), ("/v1/messages/count_tokens", counted)):
        r = http.post(path, json=sent)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        message = r.json()["error"]["message"]
        assert message.startswith(says) and "ChatCompletionRequest" not in message, message
    assert_still_serving(http)


def test_a_schema_whose_refs_chain_deeper_than_the_limit_is_400_and_the_server_lives(http):
    """llguidance compiles a schema by native recursion on the engine thread: a chain of 1,000 `$defs`, each an
    object whose property refers to the next (75 KB), overflowed its stack and the server died (SIGSEGV)
    mid-request. A constraining schema deeper than the limit with its $refs followed (through pointers,
    anchors or $ids, a cycle included) is a 400 naming the schema; a recursive one (a tree) still serves."""
    def chained(n: int) -> dict:
        defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
        return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}

    anchored = {"$defs": {f"d{i}": {"$anchor": f"a{i}", "type": "array", "items": {"$ref": f"#a{(i + 1) % 1000}"}}
                          for i in range(1000)}, "$ref": "#a0"}
    for schema in (chained(1000), anchored):
        r = chat(http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert_error(r, 400, "invalid_value", "response_format.json_schema.schema")
        assert "deeper than" in r.json()["error"]["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": chained(1000)}}
    assert_error(chat(http, tools=[tool], tool_choice="required"), 400, "invalid_value", "tools.0.function.parameters")
    r = chat(http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}})
    assert_error(r, 400, "invalid_value", "response_format.json_schema.schema")
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"},
                                                                                  "maxItems": 1}}}
    for schema in (tree, chained(20)):
        r = chat(http, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                 max_tokens=20, temperature=0)
        assert r.status_code == 200, r.text
    assert_still_serving(http)
