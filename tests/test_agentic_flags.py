"""--reasoning-parser none and --tool-call-parser none, in-process (real demo Engine and engine thread):
the answer stays in `content` and no tool_calls come back (a call cannot be forced without a parser)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.server.app import create_app
from cairn.server.options import ServerOptions

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT = {"model": "cairn-demo-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "temperature": 0}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(config_with_overrides(EngineConfig(), kv_cache_gib=0.01, state_cache_gib=0.01, max_model_len=512,
                                        max_num_seqs=2))


def answer(engine: Engine, options: ServerOptions, **change) -> dict:
    with TestClient(create_app(engine, options)) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, **change})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]


def test_reasoning_parser_none_returns_the_thinking_as_content(engine):
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    parsed = answer(engine, ServerOptions(), **thinking)["message"]
    raw = answer(engine, ServerOptions(reasoning_parser="none"), **thinking)["message"]
    assert parsed["content"] == "" and parsed["reasoning_content"] == raw["content"] != ""
    assert "reasoning_content" not in raw


def test_tool_call_parser_none_returns_no_tool_calls(engine):
    forced = {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    parsed = answer(engine, ServerOptions(), **forced, max_tokens=64)  # the call's tags are generated, byte by byte
    assert parsed["finish_reason"] == "tool_calls" and parsed["message"]["tool_calls"][0]["function"]["name"] == \
        "get_weather"
    raw = answer(engine, ServerOptions(tool_call_parser="none"), tools=[TOOL], tool_choice="auto")
    assert "tool_calls" not in raw["message"] and raw["finish_reason"] in ("length", "stop")
    with TestClient(create_app(engine, ServerOptions(tool_call_parser="none"))) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, **forced})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
