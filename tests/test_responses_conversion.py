"""A Responses API request becomes the equivalent chat request (what the template then renders); the store of
responses keeps its bounds."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cairn.server.errors import APIError, from_validation_errors
from cairn.server.openai.responses.items import decode_reasoning, encode_reasoning
from cairn.server.openai.responses.output import ResponseStore
from cairn.server.openai.responses.request import ResponsesRequest, in_responses_names

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_items_become_chat_messages_with_reasoning_tool_calls_and_tool_results():
    body = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "reasoning": {"effort": "low", "summary": "auto"}, "temperature": 0.5, "top_p": 0.9, "user": "u",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                            {"type": "input_text", "text": "in Oslo?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "use the tool"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}', "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "dry"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "answer now"}]},
            {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
        ]})
    chat = body.to_chat()
    calls = [{"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
             {"type": "function", "id": "call_2", "function": {"name": "get_weather", "arguments": {}}}]
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief.\n\nUse metric units."},
        {"role": "user", "content": "Weather\nin Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "use the tool", "tool_calls": calls},
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
        {"role": "tool", "content": "dry", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "", "reasoning_content": "answer now", "tool_calls": [
            {"type": "function", "id": "call_3", "function": {"name": "get_weather", "arguments": {}}}]},
    ]
    assert chat.template_kwargs()["enable_thinking"] is True
    assert chat.requested_max_tokens == 9 and chat.temperature == 0.5 and chat.top_p == 0.9 and chat.user == "u"
    assert chat.parallel_tool_calls is False and list(chat.forced_tools()) == ["get_weather"]
    assert chat.tools[0].function.strict is True  # OpenAI's default for a function tool


def test_a_string_input_is_one_user_message_and_effort_none_turns_thinking_off():
    chat = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": "none"}}).to_chat()
    assert chat.template_messages() == [{"role": "user", "content": "Hi"}]
    assert chat.template_kwargs()["enable_thinking"] is False
    assert "enable_thinking" not in ResponsesRequest.model_validate({"input": "Hi"}).to_chat().template_kwargs()


def test_previous_conversation_comes_first_and_its_instructions_are_not_inherited():
    prior = [{"type": "message", "role": "user", "content": "My name is Ada."},
             {"type": "message", "role": "assistant", "id": "msg_1",
              "content": [{"type": "output_text", "text": "Hello Ada.", "annotations": [], "logprobs": []}]}]
    body = ResponsesRequest.model_validate({"input": "Who am I?", "instructions": "New rules.",
                                            "previous_response_id": "resp_1"})
    assert body.to_chat(prior).template_messages() == [
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."}, {"role": "user", "content": "Who am I?"}]


@pytest.mark.parametrize(("fmt", "expected"), [
    ({"type": "text"}, {"type": "text"}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "o", "schema": {"type": "object"}, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}, "strict": True}}),
])
def test_text_format_is_the_response_format(fmt, expected):
    chat = ResponsesRequest.model_validate({"input": "x", "text": {"format": fmt}}).to_chat()
    assert chat.response_format.model_dump(by_alias=True, exclude_none=True) == expected


def _refused_param(body: dict) -> str:
    try:
        ResponsesRequest.model_validate(body).to_chat()
    except APIError as e:
        assert e.status == 400
        return e.param
    except ValidationError as e:
        return from_validation_errors(e.errors(include_url=False)).param
    raise AssertionError(f"accepted: {body}")


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.1.type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.output.0.type"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]}, "input.0"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include.1"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"summary": "concise"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"stream_options": {"include_obfuscation": True}, "stream": True}, "stream_options.include_obfuscation"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"text": {"format": {"type": "json_schema", "name": "o"}}}, "text.format.schema"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
    ({"seed": 1}, "seed"),  # not a field of this API
    ({"input": None}, "input"),
])
def test_what_cairn_does_not_implement_is_refused_naming_the_field(extra, param):
    assert _refused_param({"model": "m", "input": "x", **extra}) == param


def test_encrypted_reasoning_cairn_made_comes_back_as_the_reasoning():
    encoded = encode_reasoning("thought ü")
    assert decode_reasoning(encoded) == "thought ü" and "thought" not in encoded
    body = ResponsesRequest.model_validate({"include": ["reasoning.encrypted_content"], "input": [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "encrypted_content": encoded},
        {"role": "assistant", "content": "a"}]})
    assert body.to_chat().template_messages()[1] == {"role": "assistant", "content": "a",
                                                     "reasoning_content": "thought ü"}


def test_neutral_values_of_unimplemented_fields_are_accepted():
    body = {"input": "x", "background": False, "include": [], "prompt_cache_retention": None, "conversation": None,
            "truncation": "disabled", "service_tier": "auto", "top_logprobs": 0, "prompt_cache_key": "k",
            "safety_identifier": "s", "max_tool_calls": 3, "text": {"verbosity": "medium"}, "store": False}
    assert ResponsesRequest.model_validate(body).to_chat().messages[0].content == "x"


def test_chat_errors_are_renamed_to_this_apis_fields():
    e = APIError(400, "tools.0.function.parameters: bad; response_format.json_schema.schema: bad; max_tokens big",
                 param="tools.0.function.parameters")
    renamed = in_responses_names(e)
    assert renamed.param == "tools.0.parameters"
    assert renamed.message == "tools.0.parameters: bad; text.format.schema: bad; max_output_tokens big"
    assert in_responses_names(APIError(400, "m", param="messages.3.content")).param == "input"


def test_the_store_evicts_the_least_recently_used_within_its_count_and_byte_caps():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for name in ("a", "b"):
        assert store.put({"id": name}, None, [{"text": name}])
    assert store.get("a") is not None  # a is now the most recently used
    store.put({"id": "c"}, None, [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert not store.put({"id": "huge"}, None, [{"text": "x" * 20_000}])  # alone over the byte cap: not kept
    store.put({"id": "d"}, None, [{"text": "y" * 9_960}])  # 9985 bytes: the others go
    assert len(store) == 1 and store.get("d") is not None and store.num_bytes <= 10_000
    assert store.delete("d") and not store.delete("d") and store.num_bytes == 0


def test_a_stored_follow_up_holds_the_whole_conversation_and_counts_its_bytes():
    store = ResponseStore()
    store.put({"id": "a"}, None, [{"text": "hi"}, {"text": "hello"}])
    store.put({"id": "b"}, store.get("a"), [{"text": "more"}])
    assert store.conversation("b") == [{"text": "hi"}, {"text": "hello"}, {"text": "more"}]
    b = store.get("b")
    assert b.size == len(json.dumps({"id": "b"})) + b.conversation_bytes
    assert b.conversation_bytes == len(json.dumps([{"text": "hi"}, {"text": "hello"}])) + len(json.dumps([
        {"text": "more"}]))
    store.delete("a")
    assert store.conversation("b")[0] == {"text": "hi"}  # a follow-up outlives the response it followed


NAMESPACE = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn", "description": "Start one.", "strict": False,
                        "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]}


def test_a_namespace_tools_functions_are_chat_tools_named_namespace_dot_name():
    """The Codex CLI sends its sub-agent tools as a namespace (refused as an unsupported tool type before): each
    function is the chat tool `<namespace>.<name>`, described after the namespace, and a function_call item of
    the namespace is that chat tool's call."""
    body = ResponsesRequest.model_validate({"model": "m", "tools": [WEATHER, NAMESPACE], "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "namespace": "agents", "name": "spawn", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "started"}]})
    chat = body.to_chat()
    assert [t.function.name for t in chat.tools] == ["get_weather", "agents.spawn"]
    assert chat.tools[1].function.description == "Sub-agents.\n\nStart one."
    assert chat.messages[1].tool_calls[0].function.name == "agents.spawn"
    assert body.call_name("agents.spawn") == ("agents", "spawn")
    assert body.call_name("get_weather") == (None, "get_weather")
    assert body.call_name("other.spawn") == (None, "other.spawn")


@pytest.mark.parametrize(("tools", "param"), [
    ([NAMESPACE, {**NAMESPACE, "name": "other"}, {**WEATHER, "name": "agents.spawn"}], "tools.2.name"),
    ([{**NAMESPACE, "tools": [*NAMESPACE["tools"], NAMESPACE["tools"][0]]}], "tools.0.tools.1.name"),
    ([{**NAMESPACE, "tools": [{"type": "custom", "name": "patch"}]}], "tools.0.tools.0.type"),
])
def test_a_namespace_tool_clashing_or_holding_what_cairn_does_not_take_is_refused_naming_it(tools, param):
    with pytest.raises(APIError) as e:
        ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": tools})
    assert e.value.status == 400 and e.value.param == param
