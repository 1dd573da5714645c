"""Access control on a real `cairn serve` process: the API key (from CAIRN_API_KEY), CORS origins,
and X-Request-Id echoed and used in the request's log lines."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server_process import served_fixture

KEY = "sk-test-7f3a"
ORIGIN = "https://app.example"
COMPLETION = {"prompt": "hi", "max_tokens": 2}


served = served_fixture("--allowed-origins", ORIGIN, "--log-level", "INFO", env={"CAIRN_API_KEY": KEY})


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                         ("GET", "/v1/models"), ("GET", "/v1/models/cairn-demo-random"),
                                         ("GET", "/metrics")])
@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": KEY}], ids=["none", "wrong", "no-bearer"])
def test_every_endpoint_but_health_needs_the_api_key(server, method, path, headers):
    r = httpx.request(method, server.base_url + path, json=COMPLETION if method == "POST" else None, headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == {
        "message", "type", "param", "code"}
    assert r.headers["www-authenticate"] == "Bearer"


def test_health_needs_no_api_key(server):
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_the_api_key_opens_every_endpoint(server):
    r = httpx.post(server.base_url + "/v1/completions", json=COMPLETION, headers=auth(), timeout=60)
    assert r.status_code == 200
    assert httpx.get(server.base_url + "/v1/models", headers=auth()).status_code == 200
    assert httpx.get(server.base_url + "/metrics", headers=auth()).status_code == 200
    assert httpx.get(server.base_url + "/metrics", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_the_x_api_key_header_opens_every_endpoint_as_the_bearer_token_does(server):
    """Anthropic's API takes the key as `x-api-key` (its documented requests send it so): /v1/messages, and
    every other endpoint, take it; a wrong one is a 401."""
    anthropic = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    r = httpx.post(server.base_url + "/v1/messages", headers=anthropic, timeout=60, json={
        "model": "cairn-demo-random", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = httpx.post(server.base_url + "/v1/completions", json=COMPLETION, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(server.base_url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.get(server.base_url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_refused_key_on_v1_messages_is_an_anthropic_authentication_error(server):
    """Anthropic's clients read error.type: the 401 on /v1/messages has Anthropic's shape, OpenAI's elsewhere."""
    r = httpx.post(server.base_url + "/v1/messages", headers={"x-api-key": "wrong"}, timeout=60, json={
        "model": "cairn-demo-random", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
    assert set(body["error"]) == {"type", "message"} and "x-api-key" in body["error"]["message"]
    r = httpx.post(server.base_url + "/v1/chat/completions", headers={"x-api-key": "wrong"}, json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_cors_preflight_from_an_allowed_origin_is_answered_without_the_key(server):
    r = httpx.options(server.base_url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(server.base_url + "/v1/completions", json=COMPLETION, headers={**auth(), "Origin": ORIGIN},
                   timeout=60)
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_cors_refuses_other_origins(server):
    r = httpx.options(server.base_url + "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(server.base_url + "/v1/models", headers={**auth(), "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_x_request_id_is_echoed_and_names_the_request_in_the_logs(server):
    r = httpx.post(server.base_url + "/v1/completions", json=COMPLETION, timeout=60,
                   headers={**auth(), "X-Request-Id": "trace-42 x"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42 x"
    assert r.json()["id"].startswith("cmpl-trace-42_x-")
    assert re.search(rf"finished {re.escape(r.json()['id'])}:", server.log()), server.log()
    r = httpx.get(server.base_url + "/v1/models", headers={"X-Request-Id": "refused-1"})  # on errors too
    assert r.status_code == 401 and r.headers["x-request-id"] == "refused-1"
