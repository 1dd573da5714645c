"""What a web page, or another user of the machine, can do to a real `cairn serve` on loopback (issue 43):
POST bodies are JSON only (415 otherwise: a page's cross-origin `text/plain` POST needs no CORS preflight),
a Host that does not name the server is a 421 (a DNS rebinding page's), /health answers while the connection
cap is reached (/ready does not), and the API key and the Redis URL come from a file or the environment
without their secrets reaching the log."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
import pytest

from cairn import cli
from tests.server_process import served_fixture, start_server

MAX_CONNECTIONS = 4
served = served_fixture("--allowed-hosts", "cairn.internal", "--max-connections", str(MAX_CONNECTIONS),
                        "--max-model-len", "256")
TOKENIZE = {"model": "cairn-demo-random", "prompt": "hi"}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                                  "/tokenize", "/v1/cache/probe"])
def test_a_post_whose_body_is_not_sent_as_json_is_a_415_naming_the_content_type(http, path, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    r = http.post(path, content=b'{"model": "cairn-demo-random", "prompt": "hi"}', headers=headers)
    assert r.status_code == 415, r.text
    message = r.json()["error"]["message"]
    assert (content_type or "no Content-Type") in message, message


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.cairn+json"])
def test_a_json_body_is_taken_with_any_json_media_type(http, content_type):
    r = http.post("/tokenize", content=b'{"model": "cairn-demo-random", "prompt": "hi"}',
                  headers={"content-type": content_type})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil"])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/health"),
                                         ("POST", "/tokenize")])
def test_a_host_that_does_not_name_a_loopback_server_is_a_421(server, host, method, path):
    port = urlsplit(server.base_url).port
    r = httpx.request(method, server.base_url + path, json=TOKENIZE if method == "POST" else None,
                      headers={"host": host.format(port=port)})
    assert r.status_code == 421, r.text
    assert r.json()["error"]["code"] == "invalid_host"


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "cairn.internal", "LOCALHOST."])
def test_the_names_of_a_loopback_server_and_allowed_hosts_are_answered(server, host):
    port = urlsplit(server.base_url).port
    r = httpx.post(server.base_url + "/tokenize", json=TOKENIZE, headers={"host": f"{host}:{port}"})
    assert r.status_code == 200, r.text


def test_health_answers_200_while_the_connection_cap_is_reached_and_ready_503(server):
    """/health is liveness: a server at its connection cap is busy, not dead, and an orchestrator that restarts
    it for that would drop every open stream. /ready is the signal to send no more traffic."""
    url = urlsplit(server.base_url)
    idle = [socket.create_connection((url.hostname, url.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        assert httpx.get(server.base_url + "/health").status_code == 200
        r = httpx.get(server.base_url + "/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
        r = httpx.get(server.base_url + "/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
    finally:
        for s in idle:
            s.close()
    for _ in range(50):  # (the server sees the closed connections go as it reads them)
        if httpx.get(server.base_url + "/ready").status_code == 200:
            break
    assert httpx.get(server.base_url + "/ready").json() == {"status": "ready"}


def test_the_api_key_and_the_redis_url_from_a_file_or_the_environment_never_reach_the_log(tmp_path):
    key, password = "sk-from-a-file-51c2", "redis-pw-9d7e"
    (tmp_path / "key").write_text(key + "\n")
    server = start_server("--api-key-file", str(tmp_path / "key"), "--log-level", "DEBUG",
                          env={"CAIRN_REMOTE_CACHE": f"redis://:{password}@127.0.0.1:1/0"})
    try:
        chat = {"model": "cairn-demo-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(server.base_url + "/v1/chat/completions", json=chat).status_code == 401
        r = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=60,
                       headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text  # (Redis does not answer: a miss, never a failure)
    finally:
        server.stop()
    log = server.log()
    assert "redis://:***@127.0.0.1:1/0" in log, log
    assert password not in log and key not in log, log


def test_a_secret_flag_and_its_file_together_are_refused_and_a_bad_url_is_not_echoed(tmp_path, capsys):
    (tmp_path / "key").write_text("k\n")
    assert cli.main(["serve", "--api-key", "k", "--api-key-file", str(tmp_path / "key")]) == 2
    assert "give one" in capsys.readouterr().err
    assert cli.main(["serve", "--remote-cache", "http://:hunter2@host:6379"]) == 2
    err = capsys.readouterr().err
    assert "--remote-cache must be" in err and "hunter2" not in err
