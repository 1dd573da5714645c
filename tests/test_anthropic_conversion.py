"""An Anthropic Messages request becomes the equivalent chat request (what the template then renders)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cairn.server.anthropic.request import CountTokensRequest, MessagesRequest
from cairn.server.errors import APIError, from_validation_errors


def test_blocks_become_chat_messages_with_reasoning_tool_calls_and_tool_results():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "S"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}]},
        ]})
    chat = body.to_chat()
    assert chat.template_messages() == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "use the tool",
         "tool_calls": [{"type": "function", "id": "toolu_1",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "Thanks"},
    ]
    assert chat.template_kwargs()["enable_thinking"] is True
    assert chat.thinking_token_budget == 1024
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert list(chat.forced_tools()) == ["get_weather"]  # `any`: a call is forced


def test_unimplemented_and_unknown_fields_are_refused():
    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValueError, match=r"\bn\b"):  # the Messages API has no n
        MessagesRequest.model_validate({**base, "n": 2})
    with pytest.raises(ValueError, match="service_tier"):
        MessagesRequest.model_validate({**base, "service_tier": "auto"})


BASE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}


def _refused_param(body: dict) -> str:
    with pytest.raises(APIError) as e:
        MessagesRequest.model_validate(body)
    assert e.value.status == 400
    return e.value.param


def test_two_tools_with_the_same_name_are_refused_naming_the_second():
    tools = [{"name": name, "input_schema": {"type": "object"}} for name in ("a", "a")]
    assert _refused_param({**BASE, "tools": tools}) == "tools.1.name"


@pytest.mark.parametrize("field,value,param", [
    ("tool_choice", {"type": "auto", "name": "get_weather"}, "tool_choice.name"),
    ("thinking", {"type": "disabled", "budget_tokens": 1024}, "thinking.budget_tokens"),
    ("thinking", {"type": "adaptive", "budget_tokens": 1024}, "thinking.budget_tokens"),
])
def test_tool_choice_name_or_thinking_budget_beside_a_type_that_does_not_read_it_is_refused(field, value, param):
    assert _refused_param({**BASE, field: value}) == param


def test_metadata_other_than_user_id_is_refused_naming_it():
    assert MessagesRequest.model_validate({**BASE, "metadata": {"user_id": "u"}}).metadata.user_id == "u"
    with pytest.raises(ValueError, match="metadata.session"):
        MessagesRequest.model_validate({**BASE, "metadata": {"user_id": "u", "session": "s"}})


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "a"}])
def test_stop_sequences_with_a_tool_choice_that_forces_a_call_are_refused_naming_stop_sequences(choice):
    """A stop inside the forced call would end it invalid (it came back as a tool_use with input {})."""
    tools = [{"name": "a", "input_schema": {"type": "object"}}]
    body = {**BASE, "tools": tools, "tool_choice": choice}
    assert _refused_param({**body, "stop_sequences": ["</parameter>"]}) == "stop_sequences"
    auto = MessagesRequest.model_validate({**BASE, "tools": tools, "tool_choice": {"type": "auto"},
                                           "stop_sequences": ["END"]})
    assert auto.to_chat().stop == ["END"]


def test_a_prefill_becomes_a_continued_final_message():
    chat = MessagesRequest.model_validate({**BASE, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "text", "text": "{"}]}]}).to_chat()
    assert chat.continue_final_message and chat.template_messages()[-1] == {"role": "assistant", "content": "{"}
    assert chat.prompt_kwargs() == {"continue_final_message": True}
    assert not MessagesRequest.model_validate(BASE).to_chat().continue_final_message


@pytest.mark.parametrize(("fields", "last", "param"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "It is", "thinking"),
    ({}, [{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "messages.1.content"),
    ({}, [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "It is"}], "messages.1.content"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "{", "output_config.format"),
])
def test_a_prefill_with_thinking_a_tool_use_or_an_output_format_is_refused_naming_it(fields, last, param):
    body = MessagesRequest.model_validate({**BASE, **fields, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": last}]})
    with pytest.raises(APIError) as e:
        body.to_chat()
    assert e.value.status == 400 and e.value.param == param


def _user(*blocks: dict) -> dict:
    return {**BASE, "messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(("body", "param", "says"), [
    (_user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}),
     "messages.0.content.0", "'image'"),
    ({**BASE, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type", "'custom'"),
    (_user({"type": "text"}), "messages.0.content.0.text", "Field required"),
    (_user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}),
     "messages.0.content.0.content.0.type", "'text'"),
])
def test_a_block_or_tool_the_server_does_not_take_is_refused_naming_it(body, param, says):
    """The 400 names the block or tool and what is wrong with it, not the `str` alternative of a content
    given as a list (`Input should be a valid string`) nor the fields of a type it is not."""
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate(body)
    error = from_validation_errors(e.value.errors(include_url=False))
    assert error.param == param and says in error.message, error.message


def test_count_tokens_takes_the_prompt_fields_a_messages_request_takes_cache_control_included():
    """A client counts the tokens of the very body it sends: top-level cache_control (automatic prompt
    caching), accepted by /v1/messages, was an unknown field to /v1/messages/count_tokens."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "cache_control": {"type": "ephemeral"}}
    assert CountTokensRequest.model_validate(body).to_chat().template_messages() == [{"role": "user", "content": "x"}]
    assert MessagesRequest.model_validate({**body, "max_tokens": 5}).to_chat().template_messages() == \
        [{"role": "user", "content": "x"}]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_output_config_format_becomes_the_chats_json_schema_response_format():
    chat = MessagesRequest.model_validate({**BASE, "output_config": {"format": {"type": "json_schema",
                                                                                "schema": SCHEMA}}}).to_chat()
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == SCHEMA
    assert CountTokensRequest.model_validate({k: v for k, v in BASE.items() if k != "max_tokens"} |
                                             {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})


@pytest.mark.parametrize(("fields", "param"), [
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "stop_sequences": ["}"]},
     "stop_sequences"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "tools": [
        {"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}}, "output_config.format"),
])
def test_output_config_it_cannot_honour_is_refused_naming_it(fields, param):
    assert _refused_param({**BASE, **fields}) == param


def test_the_anthropic_clients_own_response_blocks_dumped_back_are_accepted():
    """An agent that keeps its transcript as the client's blocks' model_dump() sends a tool_use block with
    `caller` and `toolset_name` null (fields of the client's request types too): they were unknown fields, a
    400. A direct caller (the model's own call) is accepted; a toolset is refused naming it."""
    import anthropic.types

    use = anthropic.types.ToolUseBlock(id="toolu_1", name="f", input={"a": 1}, type="tool_use").model_dump()
    text = anthropic.types.TextBlock(text="calling", type="text").model_dump()
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok", "toolset_name": None}
    body = {**BASE, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [text, use]},
                                 {"role": "user", "content": [result]}]}
    chat = MessagesRequest.model_validate(body).to_chat().template_messages()
    assert [m["role"] for m in chat] == ["user", "assistant", "tool"] and chat[1]["tool_calls"][0]["id"] == "toolu_1"
    direct = {**use, "caller": {"type": "direct"}}
    MessagesRequest.model_validate({**body, "messages": [
        body["messages"][0], {"role": "assistant", "content": [direct]}]})
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate({**body, "messages": [
            body["messages"][0], {"role": "assistant", "content": [{**use, "toolset_name": "mcp"}]}]})
    assert from_validation_errors(e.value.errors(include_url=False)).param == "messages.1.content.0.toolset_name"


@pytest.mark.parametrize(("field", "value"), [("temperature", 1.5), ("temperature", -0.1), ("top_p", 1.2),
                                              ("top_k", -1)])
def test_sampling_fields_outside_the_messages_apis_ranges_are_refused_naming_them(field, value):
    """Anthropic's temperature runs 0-1 (the chat API's 0-2): a 1.5 was passed on and sampled with, an answer
    the Messages API does not give."""
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate({**BASE, field: value})
    assert from_validation_errors(e.value.errors(include_url=False)).param == field
    assert MessagesRequest.model_validate({**BASE, "temperature": 1.0, "top_p": 1.0, "top_k": 0}).to_chat()


def test_output_config_effort_high_anthropics_default_is_accepted_and_another_level_refused_naming_it():
    """Claude Code sends effort "high" (the API's default) on every request: it was a 400."""
    assert MessagesRequest.model_validate({**BASE, "output_config": {"effort": "high"}}).to_chat()
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate({**BASE, "output_config": {"effort": "low"}})
    assert from_validation_errors(e.value.errors(include_url=False)).param == "output_config.effort"


def _thinking_turns(context_management: dict | None) -> list[str | None]:
    turns = [{"role": "user", "content": "q1"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "t1", "signature": ""},
                                               {"type": "text", "text": "a1"}]},
             {"role": "user", "content": "q2"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "t2", "signature": ""},
                                               {"type": "text", "text": "a2"}]},
             {"role": "user", "content": "q3"}]
    body = {**BASE, "messages": turns} | ({"context_management": context_management} if context_management else {})
    chat = MessagesRequest.model_validate(body).to_chat()
    return [m.reasoning_content for m in chat.messages if m.role == "assistant"]


def test_clear_thinking_drops_the_thinking_of_all_but_the_last_kept_assistant_turns():
    """Claude Code sends context_management clear_thinking_20251015 with keep "all" (an unknown field before)."""
    edit = {"type": "clear_thinking_20251015"}
    assert _thinking_turns(None) == ["t1", "t2"]
    assert _thinking_turns({"edits": [{**edit, "keep": "all"}]}) == ["t1", "t2"]
    assert _thinking_turns({"edits": [{**edit, "keep": {"type": "all"}}]}) == ["t1", "t2"]
    assert _thinking_turns({"edits": [edit]}) == [None, "t2"]  # Anthropic's default keep: one turn
    assert _thinking_turns({"edits": [{**edit, "keep": {"type": "thinking_turns", "value": 2}}]}) == ["t1", "t2"]


def test_a_context_edit_cairn_does_not_carry_out_is_refused_naming_its_type():
    edits = [{"type": "clear_thinking_20251015", "keep": "all"}, {"type": "clear_tool_uses_20250919"}]
    assert _refused_param({**BASE, "context_management": {"edits": edits}}) == "context_management.edits.1.type"


def test_a_system_message_among_the_messages_is_a_system_message_where_it_stands():
    """Claude Code sends one after the user's first message (its agent list): a 400 on the role before."""
    body = {**BASE, "system": "top", "messages": [
        {"role": "user", "content": "q"}, {"role": "system", "content": [{"type": "text", "text": "agents: a, b"}]}]}
    chat = MessagesRequest.model_validate(body).to_chat()
    assert [(m.role, m.content) for m in chat.messages] == [("system", "top"), ("user", "q"),
                                                           ("system", "agents: a, b")]
    with pytest.raises(APIError) as e:
        MessagesRequest.model_validate({**BASE, "messages": [{"role": "user", "content": "q"}, {
            "role": "system", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}).to_chat()
    assert e.value.param == "messages"


def test_a_first_message_of_role_system_is_refused_naming_it():
    """A system message stands between turns; a system prompt goes in `system` (a lone system message was a 400
    on its role before system messages were taken, and stays one)."""
    assert _refused_param({**BASE, "messages": [{"role": "system", "content": "x"}]}) == "messages.0.role"
