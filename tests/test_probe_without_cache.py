"""The router's probe (`POST /v1/cache/probe`) answered by a server whose prefix cache is off
(`--prefix-cache false`): it resumes nowhere, so every prompt, even one it has just served, is a cold prefill
with no tier and no estimate, and the queue is still reported for the router to balance on. In-process (real
demo Engine and engine thread behind the app)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.server.app import create_app
from cairn.server.options import ServerOptions

MODEL = "cairn-demo-random"
MESSAGES = [{"role": "user", "content": "the same question twice"}]


def test_a_server_without_a_prefix_cache_probes_every_prompt_as_cold():
    config = config_with_overrides(EngineConfig(), kv_cache_gib=0.01, state_cache_gib=0.01, max_model_len=64,
                                   max_num_seqs=4, prefix_cache=False)
    with TestClient(create_app(Engine(config), ServerOptions())) as client:
        served = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
        assert served.status_code == 200
        answer = client.post("/v1/cache/probe", json={"model": MODEL, "messages": MESSAGES}).json()
    assert answer["tokens"] > 0
    assert (answer["position"], answer["tier"], answer["est_ttft_s"], answer["remote_position"]) == (0, None, None, 0)
    assert (answer["waiting"], answer["running"]) == (0, 0)
