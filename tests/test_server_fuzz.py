"""Hostile request bodies against the app in-process (Starlette TestClient, the demo Engine and its thread):
no body makes a route answer 5xx or raise, and the failures issue 43's probe found are each a 400 naming
the field.

The property test (hypothesis, derandomized: the same examples on every run) takes a valid body of each API
(chat, completions, Responses, Messages, tokenize, the cache probes) and replaces one value at one of its
paths, or one top-level field the request model declares, with any JSON value: wrong types, lone UTF-16
surrogates and NUL in keys and values, nesting hundreds of levels deep. The context is 64 tokens and the
bodies ask for one token, so a body that is valid costs a short generation.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.server.anthropic.request import MessagesRequest
from cairn.server.app import create_app
from cairn.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from cairn.server.openai.responses.request import ResponsesRequest
from cairn.server.options import ServerOptions
from cairn.server.tokenize import REQUESTS

MODEL = "cairn-demo-random"
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": USER, "max_tokens": 1}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
RESPONSES = {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "hi"}], "max_output_tokens": 1}
MESSAGES = {"model": MODEL, "messages": USER, "max_tokens": 1, "system": "be brief"}
TOKENIZE = {"model": MODEL, "messages": USER}
BODIES = {  # route: (a valid body, the request model whose declared fields are fuzzed too)
    "/v1/chat/completions": (CHAT, ChatCompletionRequest),
    "/v1/completions": (COMPLETION, CompletionRequest),
    "/v1/responses": (RESPONSES, ResponsesRequest),
    "/v1/messages": (MESSAGES, MessagesRequest),
    "/v1/messages/count_tokens": ({k: v for k, v in MESSAGES.items() if k != "max_tokens"}, MessagesRequest),
    "/tokenize": (TOKENIZE, REQUESTS["tokenize"]),
    "/detokenize": ({"model": MODEL, "tokens": [104, 105]}, REQUESTS["detokenize"]),
    "/v1/cache/probe": (CHAT, ChatCompletionRequest),
    "/v1/cache/probe/messages": (MESSAGES, MessagesRequest),
    "/v1/cache/probe/responses": (RESPONSES, ResponsesRequest),
}
ODD_TEXT = ["\ud800", "a\udfffb", "\x00", "nul\x00in", "\ud83d\ude00", "", " ", "\u202e", "x" * 300]


@pytest.fixture(scope="module")
def client():
    config = config_with_overrides(EngineConfig(), kv_cache_gib=0.01, state_cache_gib=0.01, max_model_len=64,
                                   max_num_seqs=4)
    with TestClient(create_app(Engine(config), ServerOptions())) as c:  # (a handler's exception fails the test)
        yield c


def post(client: TestClient, path: str, body) -> object:
    """`body` sent as a client's JSON encoder sends it: a lone surrogate as its `\\ud800` escape."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"content-type": "application/json"})


def nested(depth: int, leaf) -> object:
    for i in range(depth):
        leaf = {"a": leaf} if i % 2 else [leaf]
    return leaf


def nested_body(body: dict, field: str, depth: int) -> bytes:
    """`body` with `field` nested `depth` levels deep, as text (json.dumps recurses: it stops near 1000)."""
    value = '{"a": [' * (depth // 2) + "1" + "]}" * (depth // 2)
    return json.dumps({**body, field: None}).replace('null}', value + "}").encode()


texts = st.one_of(st.text(max_size=6), st.sampled_from(ODD_TEXT),
                  st.lists(st.sampled_from(ODD_TEXT), min_size=2, max_size=3).map("".join))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([-1, 0, 1, 2, 65]),
                    st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False), texts)
values = st.one_of(
    st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                 max_leaves=8),
    st.builds(nested, st.sampled_from([64, 400, 900]), scalars))


def paths(value, prefix: tuple = ()) -> list[tuple]:
    """Every path into `value`: its own (), each key and index, recursively."""
    found = [prefix]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found += paths(item, prefix + (key,))
    return found


def mutated(body: dict, path: tuple, value, new_key: str | None) -> object:
    """A deep copy of `body` with `value` at `path` (as a new key `new_key` of the dict there, if given)."""
    if not path and new_key is None:
        return value
    copy = json.loads(json.dumps(body))
    *parents, last = path if new_key is None else (*path, new_key)
    target = copy
    for key in parents:
        target = target[key]
        if not isinstance(target, dict | list):
            return copy
    if isinstance(target, dict) or isinstance(last, int):
        target[last] = value
    return copy


@st.composite
def hostile_requests(draw) -> tuple[str, object]:
    path = draw(st.sampled_from(sorted(BODIES)))
    body, model = BODIES[path]
    declared = sorted(f.alias or name for name, f in model.model_fields.items())
    how = draw(st.sampled_from(["path", "declared field", "new key"]))
    if how == "declared field":
        return path, {**body, draw(st.sampled_from(declared)): draw(values)}
    where = draw(st.sampled_from(paths(body)))
    new_key = draw(texts) if how == "new key" else None
    return path, mutated(body, where, draw(values), new_key)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=hostile_requests())
def test_no_request_body_makes_any_route_answer_5xx(client, request):
    path, body = request
    r = post(client, path, body)
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["message"], r.text


SURROGATE_KEYS = [
    ("/v1/chat/completions", {**CHAT, "metadata": {"\ud800": "v"}}, "metadata.\\ud800"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"\ud800": 1}}, "logit_bias.\\ud800"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs.\\ud800"),
    ("/v1/chat/completions", {**CHAT, "\ud800": 1}, "\\ud800"),
    ("/v1/messages", {**MESSAGES, "metadata": {"\ud800": "v"}}, "metadata.\\ud800"),
    ("/v1/responses", {**RESPONSES, "metadata": {"\ud800": "v"}}, "metadata.\\ud800"),
    ("/tokenize", {**TOKENIZE, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs.\\ud800"),
    ("/tokenize", {**TOKENIZE, "\udfff": 1}, "\\udfff"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_KEYS, ids=[f"{p}:{n}" for p, _, n in SURROGATE_KEYS])
def test_a_lone_surrogate_in_a_key_is_a_400_naming_the_field(client, path, body, param, caplog):
    """The error names the key with its JSON escape (`\\ud800`, six ASCII characters): the raw surrogate
    cannot be encoded, and rendering it failed as a 500 with an ASGI traceback in the log."""
    r = post(client, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in error["message"]
    if path != "/v1/messages":  # (Anthropic's error shape has no param)
        assert error["param"] == param
    assert not [rec for rec in caplog.records if rec.levelname in ("ERROR", "CRITICAL")]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/cache/probe/responses"])
@pytest.mark.parametrize("items", [[1, 1], ["a"], [None], [{"role": "user", "content": "hi"}, 7]],
                         ids=["ints", "string", "null", "after-an-item"])
def test_a_responses_input_list_of_non_objects_is_a_400_naming_the_item(client, path, items):
    r = post(client, path, {**RESPONSES, "input": items})
    assert r.status_code == 400, r.text
    bad = next(i for i, item in enumerate(items) if not isinstance(item, dict))
    assert r.json()["error"]["param"].startswith(f"input.{bad}"), r.text


@pytest.mark.parametrize("field", ["metadata", "chat_template_kwargs", "logit_bias", "response_format", "tools"])
@pytest.mark.parametrize("depth", [400, 5000])
def test_a_deeply_nested_value_is_answered_never_a_500(client, field, depth):
    """Nested deeper than the JSON parser recurses (5000) is a 400 saying so; 400 levels parse, and each field
    refuses them by its type (chat_template_kwargs takes any JSON: the template gets it)."""
    r = post(client, "/v1/chat/completions", nested_body(CHAT, field, depth))
    assert r.status_code == (200 if (field, depth) == ("chat_template_kwargs", 400) else 400), r.text
    if depth == 5000:
        assert "nested too deeply" in r.json()["error"]["message"], r.text


def test_nul_in_a_key_is_a_400_naming_it_and_nul_in_text_is_served(client):
    r = post(client, "/v1/chat/completions", {**CHAT, "nul\x00key": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "nul\x00key", r.text
    r = post(client, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\x00b"}]})
    assert r.status_code == 200, r.text
