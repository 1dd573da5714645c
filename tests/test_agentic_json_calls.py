"""Forced tool calls in the JSON `<tool_call>{"name": ..., "arguments": ...}</tool_call>` style (the
Qwen3 / Qwen3-Next template) from a real `cairn serve --model` process, through the official `openai`
and `anthropic` clients, streamed and not.

The checkpoint is a tiny random qwen3_5_text model whose tokenizer carries the real Qwen3 template
(tests/fixtures/templates/qwen3_json_tools.jinja) and Qwen's `<tool_call>` added tokens. Its weights
are random, so the grammar alone makes the answer a call: each test checks that the generated text is
in the JSON style (not the demo model's XML style), that the call parses, names one of the tools and
that its arguments validate against that tool's schema.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.checkpoints import write_checkpoint
from tests.server_process import served_fixture
from tests.test_agentic_api import BOUNDED
from tests.test_chat_templates import FIXTURES, write_checkpoint_tokenizer

ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
CLAUDE_TOOLS = [{"name": name, "input_schema": schema} for name, schema in SCHEMAS.items()]
JSON_CALL_START = '<tool_call>\n{"name": "'


def json_tools_checkpoint(path) -> None:
    write_checkpoint("qwen3_5_text", path)
    write_checkpoint_tokenizer(path, (FIXTURES / "qwen3_json_tools.jinja").read_text())


served = served_fixture("--max-model-len", "2048", "--max-num-seqs", "2", "--log-level", "WARNING",
                        checkpoint=json_tools_checkpoint, client_timeout_s=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def output_text(server, token_ids: list[int]) -> str:
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": token_ids}, timeout=30)
    return r.json()["prompt"]


def check_call(name: str, arguments: dict | str) -> None:
    """The call names one of the tools and its arguments validate against that tool's schema."""
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "lookup"}}],
                         ids=["required", "named"])
def test_openai_forced_json_style_call_parses_and_validates(server, client, model, tool_choice):
    ask = dict(model=model, messages=ASK, tools=BOUNDED, tool_choice=tool_choice, parallel_tool_calls=False,
               temperature=1.0, max_tokens=600)
    for seed in range(2):
        whole = client.chat.completions.create(**ask, seed=seed, extra_body={"return_token_ids": True})
        choice = whole.choices[0]
        assert output_text(server, choice.model_extra["token_ids"]).startswith(JSON_CALL_START)
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.id and call.type == "function"
        check_call(call.function.name, call.function.arguments)
        if isinstance(tool_choice, dict):
            assert call.function.name == "lookup"
        with client.chat.completions.stream(**ask, seed=seed) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
            [(call.function.name, call.function.arguments)]


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}],
                         ids=["any", "tool"])
def test_anthropic_forced_json_style_call_parses_and_validates(claude, model, tool_choice):
    ask = dict(model=model, max_tokens=600, messages=ASK, tools=CLAUDE_TOOLS,
               tool_choice={**tool_choice, "disable_parallel_tool_use": True}, extra_body={"temperature": 1.0})
    whole = claude.messages.create(**ask)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and use.id
    check_call(use.name, use.input)
    if tool_choice["type"] == "tool":
        assert use.name == "get_weather"
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    check_call(streamed.name, streamed.input)
