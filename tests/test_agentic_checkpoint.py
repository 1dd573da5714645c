"""The agentic API on tiny random checkpoints carrying the real Qwen3.5 and Qwen3 / Qwen3-Next chat
templates (in-process app, real Engine and engine thread): the prompt the server builds for a tool
conversation is transformers' own rendering, token for token; Qwen3.5's template opens `<think>`, so
the answer comes back as reasoning_content; a named tool_choice yields a call in the template's format.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.server.app import create_app
from cairn.server.options import ServerOptions
from tests.checkpoints import write_checkpoint
from tests.test_chat_templates import CONVERSATIONS, FIXTURES, TOOLS, hf_ids, server_view, write_checkpoint_tokenizer

FORCE = {"type": "function", "function": {"name": "get_weather"}}
BOUNDED = [{"type": "function", "function": {"name": "get_weather", "parameters": {  # random weights: bounded values
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False}}}, TOOLS[1]]


@pytest.fixture(scope="module", params=["qwen3_5_xml_tools.jinja", "qwen3_json_tools.jinja"])
def served(request, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint("qwen3_5_text", path)
    write_checkpoint_tokenizer(path, (FIXTURES / request.param).read_text())
    engine = Engine(config_with_overrides(EngineConfig(), model=str(path), kv_cache_gib=0.01, state_cache_gib=0.01,
                                          max_model_len=2048, max_num_seqs=2), show_progress=False)
    with TestClient(create_app(engine, ServerOptions(served_model_name="tiny"))) as client:
        yield request.param, client, AutoTokenizer.from_pretrained(str(path))


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 6, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_tool_conversation_prompt_is_transformers_rendering(served):
    _, client, hf = served
    messages = CONVERSATIONS["multi_turn_parallel_calls_with_reasoning"]
    body = chat(client, messages=messages, tools=TOOLS, return_token_ids=True)
    view, kwargs = server_view(messages, TOOLS)
    assert body["prompt_token_ids"] == hf_ids(hf, view, tools=kwargs["tools"])


def test_qwen35_template_opens_reasoning_and_forced_calls_follow_the_template(served):
    """The forced call is generated under the grammar, in the template's format (the tokenizer's added
    `<tool_call>` tokens included), and validates against the tool's schema."""
    name, client, _ = served
    answer = chat(client, messages=CONVERSATIONS["one_turn"])["choices"][0]["message"]
    forced = chat(client, messages=CONVERSATIONS["one_turn"], tools=BOUNDED, tool_choice=FORCE, return_token_ids=True,
                  max_tokens=120)
    prompt_text = client.post("/detokenize", json={"tokens": forced["prompt_token_ids"]}).json()["prompt"]
    output_text = client.post("/detokenize", json={"tokens": forced["choices"][0]["token_ids"]}).json()["prompt"]
    choice = forced["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), BOUNDED[0]["function"]["parameters"])
    if name.startswith("qwen3_5"):
        assert answer["reasoning_content"] and not answer["content"]  # the template ended the prompt in <think>
        assert prompt_text.endswith("<think>\n\n</think>\n\n")  # a forced call skips the reasoning
        assert output_text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\n")
    else:
        assert "reasoning_content" not in answer
        assert prompt_text.endswith("<|im_start|>assistant\n")
        assert output_text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {')


PREFILL = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "It is"}]


def continued_ids(hf, messages: list[dict]) -> list[int]:
    out = hf.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def test_continue_final_message_prompt_is_transformers_rendering_and_the_answer_is_content(served):
    """The answer continues the last assistant message: the prompt is transformers'
    apply_chat_template(continue_final_message=True), token for token (Qwen3.5's and Qwen3's empty
    `<think>` block before the text included; a trailing space the template trims away trimmed too), and
    the answer is content, never reasoning."""
    _, client, hf = served
    for text in ("It is", "It is \n"):
        messages = [PREFILL[0], {"role": "assistant", "content": text}]
        body = chat(client, messages=messages, continue_final_message=True, return_token_ids=True)
        assert body["prompt_token_ids"] == continued_ids(hf, messages), text
        assert not body["choices"][0]["message"].get("reasoning_content")
    refused = [({"messages": PREFILL[:1]}, "continue_final_message"),
               ({"messages": PREFILL, "tools": BOUNDED, "tool_choice": FORCE}, "tool_choice"),
               ({"messages": PREFILL, "response_format": {"type": "json_object"}}, "response_format")]
    for fields, param in refused:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 6, "continue_final_message": True,
                                                      **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_with_continue_final_message_gives_the_prompt_a_continuing_chat_request_gets(served):
    """/tokenize took no continue_final_message (a 400 unknown field): a token-id client could not get the
    prompt a continuing chat request is given, nor its message starts."""
    _, client, hf = served
    r = client.post("/tokenize", json={"model": "tiny", "messages": PREFILL, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == continued_ids(hf, PREFILL)
    chat_body = chat(client, messages=PREFILL, continue_final_message=True, return_token_ids=True)
    assert r.json()["tokens"] == chat_body["prompt_token_ids"]
    starts = r.json()["message_starts"]
    assert starts[0] == 0 and len(starts) == 2 and 0 < starts[1] < r.json()["count"]  # the user's, the assistant's
    for fields, message in [({"messages": PREFILL[:1]}, "assistant message last"),
                            ({"messages": PREFILL, "add_generation_prompt": True}, "exclude each other")]:
        r = client.post("/tokenize", json={"model": "tiny", "continue_final_message": True, **fields})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_anthropic_prefill_is_continued_not_answered_as_a_new_turn(served):
    """A last assistant message in /v1/messages (a prefill) is the start of the answer, as Anthropic's API
    has it: the prompt ends inside it (what count_tokens counts and the usage reports), and the answer,
    whole or streamed, is one text block continuing it."""
    _, client, hf = served
    expected = len(continued_ids(hf, PREFILL))
    counted = client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": PREFILL}).json()
    assert counted == {"input_tokens": expected}
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": PREFILL}
    whole = client.post("/v1/messages", json=body).json()
    assert whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"] == expected
    assert [b["type"] for b in whole["content"]] == ["text"]
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["text"]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == \
        whole["content"][0]["text"]
