"""What the served error tests assert about a refusal: the OpenAI error shape, the field it names, and that
the server keeps serving after it. Shared by the modules that send bad input to a real `cairn serve`."""

from __future__ import annotations

import httpx

MODEL = "cairn-demo-random"
CHAT = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The response is `status` with an OpenAI-shaped error (and `code` / `param` when given); the error."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1})
    assert r.status_code == 200, r.text


def chat(http: httpx.Client, **fields) -> httpx.Response:
    """A one-token chat request to the demo model with `fields` added."""
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1, **fields})
