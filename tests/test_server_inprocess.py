"""The app in-process (Starlette TestClient, real demo Engine, real engine thread), for the failures a
real server cannot be made to show on demand: engine.step() raising, a full queue, a draining or
dead engine thread, and filling max_tokens up to the context.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import pytest
from fastapi.testclient import TestClient

from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.errors import ChatTemplateError
from cairn.request.sampling_params import SamplingParams
from cairn.server.app import create_app
from cairn.server.chat.output import PROBE
from cairn.server.engine_io.bridge import EngineBridge, Submission
from cairn.server.engine_io.offload import Offload
from cairn.server.options import ServerOptions

MODEL = "cairn-demo-random"
MAX_MODEL_LEN = 64
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine() -> Engine:
    config = config_with_overrides(EngineConfig(), kv_cache_gib=0.01, state_cache_gib=0.01,
                                   max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    return Engine(config)


@pytest.fixture
def app(engine):
    return create_app(engine, ServerOptions())


@pytest.fixture
def client(app):
    with TestClient(app) as c:
        yield c


def metric(client: TestClient, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def fail_step_on_call(engine: Engine, monkeypatch, call_number: int) -> None:
    real_step, calls = engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == call_number:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine, "step", step)


def test_step_exception_fails_the_request_with_500_and_the_server_keeps_serving(client, engine, monkeypatch):
    fail_step_on_call(engine, monkeypatch, 1)
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "injected fault" in r.json()["error"]["message"]
    assert metric(client, "cairn_engine_step_failures_total") == 1
    assert metric(client, 'cairn_requests_finished_total{finish_reason="error"}') == 1
    assert metric(client, "cairn_num_requests_running") == 0
    assert metric(client, "cairn_kv_pages_free") + metric(client, "cairn_kv_pages_cached") == \
        metric(client, "cairn_kv_pages_total")  # nothing held but what the prefix cache keeps
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert client.get("/health").status_code == 200


def test_step_exception_mid_stream_sends_an_error_event_then_done(client, engine, monkeypatch):
    fail_step_on_call(engine, monkeypatch, 3)
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"code":"internal_error"' in events[-2]
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_queue_full_is_429_with_retry_after(client, engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler, "max_waiting", 0)
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 0)  # no seat free either: nothing may wait
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]


def test_draining_server_refuses_new_requests_with_503(client, app):
    app.state.ctx.bridge.drain(timeout_s=30)
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"



def test_a_stream_whose_step_runs_past_the_drain_deadline_ends_with_its_error_event_at_the_deadline(
        client, app, engine, monkeypatch):
    """The engine thread aborts what is left at a drain's deadline only between steps; a step running past it (a
    long prefill) held the stream until uvicorn cancelled its task, cutting it without its error event. The
    stream now ends at the deadline while the step still runs, and the request is freed once the step returns."""
    real_step, entered, release = engine.step, threading.Event(), threading.Event()
    calls = [0]

    def step():
        calls[0] += 1
        if calls[0] == 2:  # the first decode step: hold it as a long step would be
            entered.set()
            release.wait(20)
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    events: list[str] = []
    try:
        with client.stream("POST", "/v1/chat/completions",
                           json={**CHAT, "stream": True, "max_tokens": 8}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            events.append(next(lines))
            assert entered.wait(20)
            app.state.ctx.bridge.drain(timeout_s=0.2)
            events.extend(lines)
            ended_inside_the_step = not release.is_set()
    finally:
        release.set()
    assert ended_inside_the_step
    assert events[-1] == "data: [DONE]" and '"code":"shutting_down"' in events[-2], events[-3:]
    deadline = time.monotonic() + 10
    while metric(client, "cairn_num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(client, "cairn_num_requests_running") == 0
    assert metric(client, "cairn_kv_pages_free") + metric(client, "cairn_kv_pages_cached") == \
        metric(client, "cairn_kv_pages_total")

def test_health_is_503_once_the_engine_thread_has_stopped(client, app):
    assert client.get("/health").status_code == 200
    app.state.ctx.bridge.stop(timeout_s=5)
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"


def test_chat_without_max_tokens_generates_up_to_the_context(client):
    r = client.post("/v1/chat/completions", json={k: v for k, v in CHAT.items() if k != "max_tokens"})
    usage = r.json()["usage"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["total_tokens"] == MAX_MODEL_LEN


def test_served_model_name_replaces_the_engine_name(engine):
    with TestClient(create_app(engine, ServerOptions(served_model_name="my-model"))) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["my-model"]
        assert c.post("/v1/chat/completions", json={**CHAT, "model": "my-model"}).json()["model"] == "my-model"


def test_model_list_and_card_validate_as_the_openai_and_anthropic_clients_types(client):
    """GET /v1/models serves both APIs' clients: the card has OpenAI's fields (id, object, created, owned_by)
    and Anthropic's (type, display_name, created_at, lifecycle), the list Anthropic's page fields; with
    those missing, the anthropic client's ModelInfo came back with display_name and created_at None."""
    import anthropic.types
    import openai.types

    listed = client.get("/v1/models").json()
    card = client.get(f"/v1/models/{MODEL}").json()
    assert listed["data"] == [card] and (listed["has_more"], listed["first_id"], listed["last_id"]) == \
        (False, MODEL, MODEL)
    assert openai.types.Model.model_validate(card).id == MODEL
    info = anthropic.types.ModelInfo.model_validate(card)
    assert (info.type, info.display_name, info.created_at.timestamp()) == ("model", MODEL, card["created"])


def recorded(real, record):
    """`real`, calling `record()` first unless it renders the chat parsers' probe conversation."""
    def wrapper(*args, **kwargs):
        if args[:1] != (PROBE,):
            record()
        return real(*args, **kwargs)
    return wrapper


def test_engine_thread_never_renders_or_tokenizes_a_server_request(client, engine, monkeypatch):
    """Templating and tokenizing happen once per request, in a worker thread: a huge prompt cannot
    stall the streams the engine thread is running. (The chat parsers' one-message probe of the
    template, rendered on the event loop, is not the request's conversation and is not counted.)"""
    calls: list[tuple[str, str]] = []
    tok = engine.tokenizer
    for name in ("render_chat", "encode_with_offsets"):
        monkeypatch.setattr(tok, name, recorded(getattr(tok, name), lambda _n=name: calls.append(
            (_n, threading.current_thread().name))))
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert [n for n, _ in calls] == ["render_chat", "encode_with_offsets"]  # once, not twice
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and len(calls) == 3
    assert all(thread.startswith("cairn-tokenize") for _, thread in calls), calls


def test_engine_thread_never_compiles_a_grammar_of_a_server_request(client, engine, monkeypatch):
    """llguidance compiles a large schema for seconds (8,000 optional properties: 6 s), with the interpreter
    lock released: compiled on the engine thread, it stopped every running stream that long. The server
    compiles a request's grammar in a worker thread, once, and the engine uses that one (n > 1 forks it)."""
    threads: list[str] = []
    compiler = engine.grammars
    monkeypatch.setattr(compiler, "compile", recorded(compiler.compile, lambda: threads.append(
        threading.current_thread().name)))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "n": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert len(threads) == 1, threads
    assert not threads[0].startswith("cairn-engine"), threads


def test_chat_without_max_tokens_fills_the_context_from_one_tokenization(client, engine, monkeypatch):
    renders = []
    real = engine.tokenizer.render_chat
    monkeypatch.setattr(engine.tokenizer, "render_chat", recorded(real, lambda: renders.append(1)))
    r = client.post("/v1/chat/completions", json={k: v for k, v in CHAT.items() if k != "max_tokens"})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert len(renders) == 1


def test_refusal_while_draining_logs_one_line_without_a_traceback(client, app, caplog):
    app.state.ctx.bridge.drain(timeout_s=30)
    with caplog.at_level(logging.INFO, logger="cairn.server.app"):
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 503
    records = [r for r in caplog.records if r.name == "cairn.server.app"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING and records[0].exc_info is None


def test_metrics_public_serves_metrics_without_the_key_and_nothing_else(engine):
    with TestClient(create_app(engine, ServerOptions(api_key="k", metrics_public=True))) as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


def test_no_cors_headers_unless_origins_are_allowed(client):
    r = client.options("/v1/chat/completions", headers={"Origin": "https://a.example",
                                                         "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


MESSAGES = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def test_step_exception_on_messages_is_an_anthropic_shaped_500_logged_with_its_traceback(client, engine, monkeypatch,
                                                                                         caplog):
    fail_step_on_call(engine, monkeypatch, 1)
    with caplog.at_level(logging.ERROR, logger="cairn.server.anthropic.messages"):
        r = client.post("/v1/messages", json=MESSAGES)
    assert r.status_code == 500
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    assert "injected fault" in r.json()["error"]["message"]
    assert any(rec.exc_info for rec in caplog.records if rec.name == "cairn.server.anthropic.messages")
    assert client.post("/v1/messages", json=MESSAGES).status_code == 200


def test_step_exception_mid_anthropic_stream_ends_it_with_an_error_event(client, engine, monkeypatch):
    fail_step_on_call(engine, monkeypatch, 3)
    with client.stream("POST", "/v1/messages", json={**MESSAGES, "stream": True}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "error" and "message_stop" not in events
    assert '"type":"api_error"' in lines[lines.index("event: error") + 1].replace(" ", "")


def test_after_the_engine_thread_stopped_metrics_still_answer_and_requests_are_refused_as_shutting_down(
        client, app, caplog):
    app.state.ctx.bridge.stop(timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="cairn.server.app"):
        r = client.get("/metrics")
    assert r.status_code == 200 and "cairn_engine_step_failures_total" in r.text  # the server's own series
    assert any("engine stats unavailable" in rec.getMessage() for rec in caplog.records)
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_an_integrity_violation_found_while_idle_is_logged_and_serving_goes_on(client, engine, monkeypatch, caplog):
    """The engine thread checks the engine's bookkeeping each time it falls idle: a violation (a bug) is
    logged with its traceback, and the server keeps answering."""
    def broken() -> None:
        raise AssertionError("injected inconsistency")

    monkeypatch.setattr(engine, "check_integrity", broken)
    with caplog.at_level(logging.ERROR, logger="cairn.server.engine_io.bridge"):
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    logged = [r for r in caplog.records if "inconsistent while idle" in r.getMessage()]
    assert logged and all("injected inconsistency" in str(r.exc_info[1]) for r in logged)
    assert client.get("/health").status_code == 200


def test_a_failed_step_whose_abort_fails_too_still_answers_its_client(client, engine, monkeypatch, caplog):
    """After a step raised, the bridge aborts the requests it ran and tells their clients; an abort that
    raises as well is logged, and the client still gets its 500 (not a request that never answers)."""
    def abort(request_id: str) -> None:
        raise RuntimeError("injected abort fault")

    fail_step_on_call(engine, monkeypatch, 1)
    real_abort = engine.abort
    monkeypatch.setattr(engine, "abort", abort)
    with caplog.at_level(logging.ERROR, logger="cairn.server.engine_io.bridge"):
        r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert any("failed" in rec.getMessage() and rec.exc_info and "injected abort fault" in str(rec.exc_info[1])
               for rec in caplog.records if rec.getMessage().startswith("engine.abort("))
    monkeypatch.setattr(engine, "abort", real_abort)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_request_cancelled_while_its_add_waits_for_the_engine_thread_is_aborted_unrun(engine):
    """A request task cancelled (as uvicorn cancels them at shutdown) while its add is queued behind other
    engine-thread work: the add still runs later, so the bridge queues an abort behind it; the request
    never runs unread, and the answer to the cancelled add is dropped (its future is already done)."""
    bridge = EngineBridge(engine, Offload(engine.tokenizer, engine.max_model_len))
    bridge.start()
    callback_errors = []

    async def scenario() -> tuple[bool, int]:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: callback_errors.append(context))
        busy, release = threading.Event(), threading.Event()

        def hold(_: Engine) -> None:
            busy.set()
            release.wait(30)

        held = asyncio.ensure_future(bridge.call(hold))
        await asyncio.to_thread(busy.wait, 30)
        task = asyncio.ensure_future(bridge.submit(Submission("cancelled-1", SamplingParams(max_tokens=4),
                                                              prompt="hello")))
        while bridge._commands.empty():  # its add is queued behind `hold`
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await held
        return await bridge.call(lambda e: (e.has_unfinished(), e.num_running))

    try:
        assert asyncio.run(scenario()) == (False, 0)
        assert callback_errors == []
    finally:
        bridge.stop(timeout_s=5)


def test_a_conversation_the_chat_template_refuses_is_a_400_naming_messages(client, engine, monkeypatch):
    """A checkpoint's template that raises on a conversation (e.g. roles it does not accept): the client
    gets the template's own message as a 400 on `messages`, and the server goes on."""
    def refuse(messages, **kwargs):
        if messages is not PROBE:
            raise ChatTemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        return real(messages, **kwargs)

    real = engine.tokenizer.render_chat
    monkeypatch.setattr(engine.tokenizer, "render_chat", refuse)
    r = client.post("/v1/chat/completions", json=CHAT)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages" and error["message"].startswith("Conversation roles")
    monkeypatch.setattr(engine.tokenizer, "render_chat", real)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_chat_message_with_a_name_is_rendered_with_it(client, engine, monkeypatch):
    """A message's optional `name` (OpenAI's field for telling participants apart) reaches the template."""
    rendered = []
    real = engine.tokenizer.render_chat
    monkeypatch.setattr(engine.tokenizer, "render_chat",
                        lambda messages, **kw: rendered.append(messages) or real(messages, **kw))
    body = {**CHAT, "messages": [{"role": "user", "name": "alice", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert [m.get("name") for m in rendered[-1]] == ["alice"]


def test_a_batch_of_several_completion_prompts_is_refused_naming_prompt(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["one", "two"], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_value"
    assert r.json()["error"]["param"] == "prompt" and "a batch of 2 prompts" in r.json()["error"]["message"]
    one = client.post("/v1/completions", json={"model": MODEL, "prompt": ["one"], "max_tokens": 2})
    assert one.status_code == 200
