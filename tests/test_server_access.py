"""Access control on a real `cairn serve` process: the API key (from CAIRN_API_KEY), CORS origins,
and X-Request-Id echoed and used in the request's log lines."""

from __future__ import annotations

import os
import re
from unittest import mock

import httpx
import pytest

from tests.server_process import start_server

KEY = "sk-test-7f3a"
ORIGIN = "https://app.example"
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def srv():
    with mock.patch.dict(os.environ, {"CAIRN_API_KEY": KEY}):
        server = start_server("--allowed-origins", ORIGIN, "--log-level", "INFO")
    yield server
    server.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                         ("GET", "/v1/models"), ("GET", "/v1/models/cairn-demo"), ("GET", "/metrics")])
@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": KEY}], ids=["none", "wrong", "no-bearer"])
def test_every_endpoint_but_health_needs_the_api_key(srv, method, path, headers):
    r = httpx.request(method, srv.base_url + path, json=COMPLETION if method == "POST" else None, headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == {
        "message", "type", "param", "code"}
    assert r.headers["www-authenticate"] == "Bearer"


def test_health_needs_no_api_key(srv):
    assert httpx.get(srv.base_url + "/health").status_code == 200


def test_the_api_key_opens_every_endpoint(srv):
    assert httpx.post(srv.base_url + "/v1/completions", json=COMPLETION, headers=auth(), timeout=60).status_code == 200
    assert httpx.get(srv.base_url + "/v1/models", headers=auth()).status_code == 200
    assert httpx.get(srv.base_url + "/metrics", headers=auth()).status_code == 200
    assert httpx.get(srv.base_url + "/metrics", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_cors_preflight_from_an_allowed_origin_is_answered_without_the_key(srv):
    r = httpx.options(srv.base_url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(srv.base_url + "/v1/completions", json=COMPLETION, headers={**auth(), "Origin": ORIGIN}, timeout=60)
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_cors_refuses_other_origins(srv):
    r = httpx.options(srv.base_url + "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(srv.base_url + "/v1/models", headers={**auth(), "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_x_request_id_is_echoed_and_names_the_request_in_the_logs(srv):
    r = httpx.post(srv.base_url + "/v1/completions", json=COMPLETION, timeout=60,
                   headers={**auth(), "X-Request-Id": "trace-42 x"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42 x"
    assert r.json()["id"].startswith("cmpl-trace-42_x-")
    assert re.search(rf"finished {re.escape(r.json()['id'])}:", srv.log()), srv.log()
    r = httpx.get(srv.base_url + "/v1/models", headers={"X-Request-Id": "refused-1"})  # on errors too
    assert r.status_code == 401 and r.headers["x-request-id"] == "refused-1"
