"""POST /v1/responses (OpenAI's Responses API) of a real `cairn serve` process, through the official `openai`
client: text, instructions, function calls and their follow-up turn, reasoning, structured output, the output
limit, streamed events, refusals, and stored responses (previous_response_id, GET, DELETE, store false).

As in test_agentic_api.py, the demo model's weights are random: calls are forced with tool_choice (the grammar
makes the answer a call), and reasoning is opened by the template (reasoning.effort -> enable_thinking).
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from tests.server_process import served_fixture

MODEL = "cairn-demo-random"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
SEARCH = {"type": "function", "name": "search", "parameters": {"type": "object", "properties": {}}, "strict": False}
GREEDY = dict(model=MODEL, temperature=0, max_output_tokens=12)
FORCED = dict(model=MODEL, temperature=0, max_output_tokens=128)
NO_THINKING = {"effort": "none"}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
         "required": ["ok", "n"], "additionalProperties": False}

served = served_fixture("--max-model-len", "2048", "--max-num-seqs", "4", "--log-level", "WARNING")


def items(response) -> list[tuple[str, str]]:
    """(type, text) of each output item: a message's text, a reasoning item's, a call's name and arguments."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content or ())))
        else:
            out.append((item.type, f"{item.name} {item.arguments}"))
    return out


# ---- text ---------------------------------------------------------------------------------------

def test_plain_text_answer(client):
    r = client.responses.create(input="Hello there", reasoning=NO_THINKING, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and r.output_text == message.content[0].text
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.reasoning.effort == "none"
    assert r.usage.model_extra["cairn"]["match_length"] >= 0  # cairn's cache report, beside OpenAI's fields


def test_instructions_are_the_system_message(client, http):
    with_instructions = client.responses.create(input="Hi", instructions="Answer in French.", reasoning=NO_THINKING,
                                                **GREEDY)
    tokens = http.post("/tokenize", json={"messages": [{"role": "system", "content": "Answer in French."},
                                                       {"role": "user", "content": "Hi"}],
                                          "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert with_instructions.usage.input_tokens == tokens["count"]
    assert with_instructions.instructions == "Answer in French."


def test_output_limit_makes_the_response_incomplete(client):
    r = client.responses.create(input="Tell me a long story", reasoning=NO_THINKING, model=MODEL, temperature=0,
                                max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[-1].status == "incomplete"


def test_reasoning_is_its_own_item_when_the_template_thinks(client):
    """reasoning.effort other than none opens the template's <think>: the random model reasons up to the limit."""
    r = client.responses.create(input="Weather in Paris?", reasoning={"effort": "high"}, **GREEDY)
    (reasoning,) = r.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
    plain = client.responses.create(input="Weather in Paris?", reasoning=NO_THINKING, **GREEDY)
    assert [i.type for i in plain.output] == ["message"]


def test_a_stateless_client_sends_its_reasoning_back_as_encrypted_content(client):
    """store false and include reasoning.encrypted_content: the reasoning item carries its text (encoded), which
    the next request's input sends back; it renders as the reasoning sent in the clear does."""
    first = client.responses.create(input="Weather?", reasoning={"effort": "high"}, store=False,
                                    include=["reasoning.encrypted_content"], **GREEDY)
    (reasoning,) = first.output
    assert reasoning.encrypted_content and reasoning.content[0].text not in reasoning.encrypted_content
    call = [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    text = reasoning.content[0].text
    turns = ([{"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content}],
             [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}], [])
    tokens = [client.responses.create(input=[{"role": "user", "content": "Weather?"}, *turn, *call], tools=[WEATHER],
                                      reasoning=NO_THINKING, store=False, **GREEDY).usage.input_tokens
              for turn in turns]
    assert tokens[0] == tokens[1] > tokens[2]  # (the reasoning of the turn in progress is rendered)


def test_json_schema_text_format_validates(client):
    fmt = {"format": {"type": "json_schema", "name": "small", "schema": SMALL, "strict": True}}
    r = client.responses.create(input="Give me JSON", text=fmt, reasoning=NO_THINKING, model=MODEL, temperature=0,
                                max_output_tokens=64)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SMALL)
    assert r.text.format.type == "json_schema" and r.text.format.name == "small"


# ---- function calls -----------------------------------------------------------------------------

def test_named_tool_choice_makes_a_function_call_and_the_next_turn_carries_its_output(client):
    r = client.responses.create(input="Weather in Paris?", tools=[WEATHER, SEARCH],
                                tool_choice={"type": "function", "name": "get_weather"}, **FORCED)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id and call.id and isinstance(json.loads(call.arguments), dict)
    assert r.tool_choice.name == "get_weather" and [t.name for t in r.tools] == ["get_weather", "search"]
    follow_up = [{"role": "user", "content": "Weather in Paris?"}, *r.output,  # as the client returned them
                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}]
    second = client.responses.create(input=follow_up, tools=[WEATHER, SEARCH], reasoning=NO_THINKING, **GREEDY)
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    assert second.usage.input_tokens > r.usage.input_tokens + len("sunny, 21C")


def test_tool_choice_required_calls_one_of_the_tools(client):
    r = client.responses.create(input="Weather in Paris?", tools=[WEATHER], tool_choice="required", **FORCED)
    assert [i.type for i in r.output] == ["function_call"] and r.output[0].name == "get_weather"
    jsonschema.validate(json.loads(r.output[0].arguments), WEATHER["parameters"])


# ---- streaming ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ask", [
    dict(input="Hello there", reasoning=NO_THINKING, **GREEDY),
    dict(input="Weather in Paris?", reasoning={"effort": "high"}, **GREEDY),
    dict(input="Weather in Paris?", tools=[WEATHER], tool_choice="required", **FORCED),
], ids=["text", "reasoning", "call"])
def test_streamed_events_reassemble_the_whole_answer(client, ask):
    """The last event (response.completed or response.incomplete) carries the answer the whole request gets, and
    the deltas spell it; a completed one is what the client's stream helper returns."""
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = events[-1].response
        if final.status == "completed":
            assert items(stream.get_final_response()) == items(whole)
    assert items(final) == items(whole) and final.status == whole.status
    assert whole.status == ("completed" if "tools" in ask else "incomplete")
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == f"response.{whole.status}" and kinds[-2] == "response.output_item.done"
    deltas = "".join(e.delta for e in events if e.type.endswith(".delta"))
    assert deltas == "".join(text if kind != "function_call" else text.split(" ", 1)[1] for kind, text in items(whole))
    assert final.usage.output_tokens == whole.usage.output_tokens


def aborted(base_url: str) -> float:
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('cairn_requests_finished_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_leaving_a_stream_aborts_the_generation(server):
    """The answer is held long by its format (a string of at least 1800 characters: no end of turn before)."""
    long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1800}}, "required": ["s"]}
    body = {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 1900, "reasoning": NO_THINKING,
            "text": {"format": {"type": "json_schema", "name": "long", "schema": long}}}
    before = aborted(server.base_url)
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["x-cairn-response-id"].startswith("resp_"), resp.read()
        next(resp.iter_lines())  # the stream has started; leave
    deadline = time.monotonic() + 60
    while aborted(server.base_url) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborted(server.base_url) == before + 1


def test_an_agent_clients_stateless_streamed_turn_is_taken_whole(http):
    """The fields a coding agent sends on each turn (instructions, a developer message, tools it does not mark
    strict, parallel_tool_calls false, store false with encrypted reasoning, a prompt_cache_key, a reasoning
    summary of auto), streamed: accepted, and the stream ends with the whole response."""
    body = {"model": MODEL, "instructions": "You are a coding agent.", "stream": True, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "tool_choice": "auto", "max_output_tokens": 8,
            "tools": [{"type": "function", "name": "shell", "description": "Run a command", "strict": False,
                       "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {
                           "type": "string"}}}, "required": ["command"]}}],
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "cwd: /"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files"}]}]}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["store"] is False
    assert final["output"][0]["type"] == "reasoning" and final["output"][0]["encrypted_content"]
    assert final["usage"]["output_tokens"] == 8


# ---- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.input_image.image_url"]}, "include.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),  # not a field of this API
    ({"reasoning": {"effort": "low", "summary": "detailed"}}, "reasoning.summary"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    # the chat path's checks, naming this API's fields
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"maximun": 3}}}}]},
     "tools.0.parameters.properties.a.maximun"),  # (strict by default, as OpenAI's: enforced or refused)
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": 1,
                                                                        "maximun": 2}}}}, "text.format.schema.maximun"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": []}, "input"),
])
def test_a_field_cairn_does_not_honour_is_refused_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="Hi", model=MODEL, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param


# ---- stored responses ---------------------------------------------------------------------------

def test_previous_response_id_continues_the_conversation_from_the_cache(client):
    """The stored conversation comes first, without its instructions (OpenAI's semantics: a client sends them
    again each turn); the prompt then resumes from the snapshots of the first turn."""
    ask = dict(instructions="Be brief.", reasoning=NO_THINKING, **GREEDY)
    first = client.responses.create(input="My name is Ada. " * 40, **ask)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, **ask)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the first turn, then this
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2  # resumed from the cache
    uninstructed = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                           reasoning=NO_THINKING, **GREEDY)
    assert uninstructed.instructions is None and uninstructed.usage.input_tokens < second.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.BadRequestError) as e:  # a stored response is returned whole, never streamed
        client.responses.retrieve(second.id, include=["message.output_text.logprobs"])
    assert e.value.body["param"] == "include[]"
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_unknown_previous_response_id_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="Hi", previous_response_id="resp_nope", **GREEDY)
    assert e.value.body["param"] == "previous_response_id" and "resp_nope" in e.value.body["message"]


def test_store_false_keeps_nothing(client):
    r = client.responses.create(input="Hi", store=False, reasoning=NO_THINKING, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Again", previous_response_id=r.id, **GREEDY)


def test_a_streamed_response_is_stored(client):
    with client.responses.stream(input="Weather?", tools=[WEATHER], tool_choice="required", **FORCED) as stream:
        final = stream.get_final_response()
    assert items(client.responses.retrieve(final.id)) == items(final) and final.output[0].type == "function_call"
