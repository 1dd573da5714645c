"""Bad input to a real `cairn serve` process: each gets an OpenAI-shaped 4xx and the server keeps serving.

Also: a client that disconnects mid-stream aborts its request and its memory returns to the pools.
One server (context 1024 tokens, 64 KiB body limit) serves the whole module.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.api_errors import MODEL, assert_error, assert_still_serving, chat
from tests.server_process import served_fixture

MAX_MODEL_LEN = 1024
MAX_REQUEST_BYTES = 65536


served = served_fixture("--max-model-len", str(MAX_MODEL_LEN), "--max-request-bytes", str(MAX_REQUEST_BYTES),
                        "--log-level", "WARNING")


def test_malformed_json_is_400_invalid_json(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "cairn-demo-random", "messages": [',
                  headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert_still_serving(http)


def test_missing_messages_is_400_missing_field(http):
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "missing_field", "messages")
    assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "missing_field", "prompt")
    assert_still_serving(http)


@pytest.mark.parametrize("field,value", [("temperature", "hot"), ("max_tokens", 1.5), ("messages", "hi"),
                                         ("stop", 7), ("stream", {"x": 1})])
def test_wrong_type_is_400_naming_the_field(http, field, value):
    error = assert_error(chat(http, **{field: value}), 400)
    assert error["param"].startswith(field)
    assert_still_serving(http)


def test_unknown_model_is_404_model_not_found(http):
    assert_error(chat(http, model="gpt-17"), 404, "model_not_found", "model")
    assert_error(http.get("/v1/models/gpt-17"), 404, "model_not_found")
    assert_still_serving(http)


def test_empty_messages_is_400(http):
    assert_error(chat(http, messages=[]), 400, param="messages")
    assert_still_serving(http)


def test_empty_prompt_is_400(http):
    assert_error(http.post("/v1/completions", json={"prompt": "", "max_tokens": 1}), 400)
    assert_still_serving(http)


def test_prompt_longer_than_the_context_is_400_saying_so(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (MAX_MODEL_LEN + 10), "max_tokens": 1})
    error = assert_error(r, 400, "context_length_exceeded", "prompt")
    assert "context" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    long_chat = [{"role": "user", "content": "x" * (MAX_MODEL_LEN + 10)}]
    assert_error(chat(http, messages=long_chat, max_tokens=None), 400, "context_length_exceeded", "messages")
    assert_still_serving(http)


@pytest.mark.parametrize("max_tokens", [-1, 0, 10**12])
def test_negative_zero_or_absurd_max_tokens_is_400(http, max_tokens):
    assert_error(chat(http, max_tokens=max_tokens), 400, param="max_tokens")
    assert_still_serving(http)


@pytest.mark.parametrize("max_tokens", [-1, 0, 10**12])
def test_negative_zero_or_absurd_max_completion_tokens_is_400_naming_it_not_max_tokens(http, max_tokens):
    """The client sent max_completion_tokens (max_tokens left out, or beside it): the error names the field
    it sent, in `param` and in the message."""
    for other in (None, 5):
        r = chat(http, max_tokens=other, max_completion_tokens=max_tokens)
        error = assert_error(r, 400, param="max_completion_tokens")
        assert "max_completion_tokens" in error["message"] and "max_tokens" not in error["message"], error
    assert_still_serving(http)


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("temperature", 1000.0), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -2), ("min_p", -0.1), ("min_p", 1.5),
                                         ("n", 0), ("n", 17), ("presence_penalty", 2.5), ("frequency_penalty", -3),
                                         ("repetition_penalty", 0.0), ("min_tokens", 99)])
def test_out_of_range_sampling_value_is_400_naming_it(http, field, value):
    assert_error(chat(http, **{field: value}), 400, "invalid_value", field)
    assert_still_serving(http)


def test_logit_bias_outside_the_vocabulary_or_range_is_400(http):
    assert_error(chat(http, logit_bias={"100000": 1}), 400, "invalid_value", "logit_bias")
    assert_error(chat(http, logit_bias={"65": 101}), 400, "invalid_value", "logit_bias")
    assert_error(chat(http, logit_bias={"A": 1}), 400, "invalid_value", "logit_bias")
    assert_still_serving(http)


def test_unusable_response_format_schema_is_400(http):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    assert_error(chat(http, response_format=bad), 400, "invalid_value", "response_format")
    assert_error(chat(http, response_format={"type": "yaml"}), 400, "invalid_value", "response_format.type")
    assert_still_serving(http)


def test_non_text_content_part_is_400(http):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert_error(chat(http, messages=image), 400, "unsupported_value")
    assert_still_serving(http)


def test_a_non_text_part_after_a_cache_marked_text_part_is_400_naming_it(http):
    parts = [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    assert_error(chat(http, messages=[{"role": "user", "content": parts}]), 400, "unsupported_value",
                 "messages.0.content.1")
    assert_still_serving(http)


def test_body_over_the_limit_is_413_from_content_length(http):
    r = http.post("/v1/completions", content=b" " * (MAX_REQUEST_BYTES + 1), headers={"content-type":
                                                                                        "application/json"})
    assert_error(r, 413, "request_too_large")
    assert_still_serving(http)


def test_chunked_body_over_the_limit_is_413_while_reading(http):
    def body():
        for _ in range(MAX_REQUEST_BYTES // 4096 + 2):
            yield b" " * 4096

    r = http.post("/v1/completions", content=body(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "request_too_large")
    assert_still_serving(http)


def test_unknown_route_is_openai_shaped_404(http):
    assert_error(http.get("/v2/nothing"), 404, "not_found")
    assert_still_serving(http)


def anthropic_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body


def test_errors_before_the_messages_handler_have_anthropics_shape_on_v1_messages(http):
    """The body limit (a middleware) and a wrong method answer /v1/messages in Anthropic's shape, as its
    handler's own errors do: an Anthropic client reads error.type, not OpenAI's error.code."""
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    anthropic_error(http.post("/v1/messages", content=b" " * (MAX_REQUEST_BYTES + 1), headers=headers),
                    413, "request_too_large")
    anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    anthropic_error(http.post("/v1/messages", json={"max_tokens": 2}), 400, "invalid_request_error")
    assert_still_serving(http)


def _metrics(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(cairn_[a-z_]+) (\S+)$", text, re.M)}


def pages_leaked(m: dict[str, float]) -> float:
    """KV pages neither free nor held by the prefix cache: 0 whenever no request is running."""
    return m["cairn_kv_pages_total"] - m["cairn_kv_pages_free"] - m["cairn_kv_pages_cached"]


def aborted(http: httpx.Client) -> float:
    m = re.search(r'^cairn_requests_finished_total\{finish_reason="abort"\} (\S+)$', http.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_client_disconnect_mid_stream_aborts_and_frees_memory(http):
    body = {"model": MODEL, "prompt": "disconnect", "max_tokens": 900, "stream": True, "ignore_eos": True}
    aborted_before = aborted(http)
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert events
        m = _metrics(http)
        assert m["cairn_num_requests_running"] == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = _metrics(http)
        if m["cairn_num_requests_running"] == 0 and pages_leaked(m) == 0:
            break
        time.sleep(0.05)
    assert m["cairn_num_requests_running"] == m["cairn_num_requests_waiting"] == 0
    assert pages_leaked(m) == 0
    assert m["cairn_state_slots_free"] == m["cairn_state_slots_total"]
    assert aborted(http) == aborted_before + 1
    assert_still_serving(http)


def test_client_disconnect_before_a_whole_response_aborts_it(http):
    body = {"model": MODEL, "prompt": "gone", "max_tokens": 900, "ignore_eos": True}
    aborted_before = aborted(http)
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = _metrics(http)
        if m["cairn_num_requests_running"] == 0 and pages_leaked(m) == 0:
            break
        time.sleep(0.05)
    assert m["cairn_num_requests_running"] == 0 and pages_leaked(m) == 0
    assert aborted(http) == aborted_before + 1
    assert_still_serving(http)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_prompt_cache_retention_is_a_400_naming_it_on_every_openai_route_not_ignored(http, route):
    """cairn does not map `prompt_cache_retention` onto its tiers' lifetimes yet, so a value is refused by name
    (a client's `in_memory` or `24h` must not silently mean nothing); `prompt_cache_key` beside it is accepted."""
    body = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
            "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}[route]
    limit = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
    for retention in ("in_memory", "24h"):
        r = http.post(route, json={"model": MODEL, limit: 16, "prompt_cache_retention": retention, **body})
        assert_error(r, 400, param="prompt_cache_retention")
    r = http.post(route, json={"model": MODEL, limit: 16, "prompt_cache_key": "conversation-1", **body})
    assert r.status_code == 200, r.text
    assert_still_serving(http)
