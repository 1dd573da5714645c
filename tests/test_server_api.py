"""The OpenAI-compatible API of a real `cairn serve` process, through the official `openai` client.

One server (demo model, tiny pools, context 1024 tokens, 64 KiB body limit) serves the whole module.
Every request asks for a handful of tokens so that the module runs in seconds on two CPU cores.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from tests.server_process import served_fixture

MODEL = "cairn-demo-random"
MAX_MODEL_LEN = 1024
MAX_REQUEST_BYTES = 65536
CHAT = [{"role": "user", "content": "Hello, cairn"}]


served = served_fixture("--max-model-len", str(MAX_MODEL_LEN), "--max-request-bytes", str(MAX_REQUEST_BYTES),
                        "--max-num-seqs", "8", "--log-level", "WARNING")


def metric(http: httpx.Client, name: str) -> float:
    """The value of one unlabeled (or exactly labeled) sample in /metrics."""
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def sse_events(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# ---- the happy paths --------------------------------------------------------------------------------

def test_health_is_200_while_engine_runs(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_models_lists_the_served_demo_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion_returns_text_and_usage_with_cache_report(client):
    fresh = [{"role": "user", "content": "A prompt no other test sends"}]
    r = client.chat.completions.create(model=MODEL, messages=fresh, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    u = r.usage
    assert u.completion_tokens == 4 and u.total_tokens == u.prompt_tokens + 4 and u.prompt_tokens > 0
    assert u.prompt_tokens_details.cached_tokens == 0
    assert set(u.cairn) == {"resume_position", "tier", "source", "miss_reason", "match_length", "snapshots_taken"}


def test_chat_stream_sends_role_content_then_usage_chunk_when_include_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 3
    assert 0 <= last.usage.prompt_tokens_details.cached_tokens <= last.usage.prompt_tokens
    assert "resume_position" in last.usage.cairn


def test_chat_content_parts_are_joined_like_a_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "cairn"}]}]
    joined = [{"role": "user", "content": "Hello,\ncairn"}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=3, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=3, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.choices[0].message.content == \
        b.choices[0].message.content


def test_completion_accepts_text_and_token_id_prompts(client):
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, extra_body={"ignore_eos": True})
    ids = client.completions.create(model=MODEL, prompt=[97, 98, 99], max_tokens=2, extra_body={"ignore_eos": True})
    assert text.object == "text_completion" and text.usage.prompt_tokens == ids.usage.prompt_tokens == 3
    assert text.usage.completion_tokens == ids.usage.completion_tokens == 2
    assert text.usage.prompt_tokens_details.cached_tokens <= 3 and "tier" in text.usage.cairn


def test_completion_stream_is_sse_ending_with_done(http):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"]) is not None


def test_chat_logprobs_report_the_chosen_token_and_top_alternatives(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_completion_integer_logprobs_give_that_many_alternatives(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 3
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)


def test_same_seed_gives_the_same_text(client):
    def run():
        return client.completions.create(model=MODEL, prompt="seed", max_tokens=6, temperature=1.0, seed=1234,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert run() == run()


def test_stop_string_ends_the_output_before_it(client):
    ask = dict(model=MODEL, prompt="stop test", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**ask).choices[0].text
    stop = next((c for c in full[2:] if c.isprintable() and c != "\ufffd"), None)
    if stop is None:
        pytest.skip("the demo model printed nothing usable as a stop string")
    r = client.completions.create(**ask, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def cached_tokens_metric(http: httpx.Client, tier: str) -> float:
    m = re.search(rf'^cairn_cached_tokens_total\{{tier="{tier}"\}} (\S+)$', http.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_repeated_prompt_reports_its_cached_tokens_in_usage_and_metrics(client, http):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Say it again, cairn"}], max_tokens=2)
    first = client.chat.completions.create(**ask).usage
    again = client.chat.completions.create(**ask).usage
    cached = again.prompt_tokens_details.cached_tokens
    assert first.prompt_tokens_details.cached_tokens < cached <= again.prompt_tokens
    assert again.cairn["tier"] is not None
    assert again.cairn["resume_position"] == cached and again.cairn["match_length"] >= cached
    assert cached_tokens_metric(http, again.cairn["tier"]) >= cached


def test_cache_prompt_false_neither_reads_nor_reports_the_cache(client):
    ask = dict(model=MODEL, prompt="cache me if you can", max_tokens=1)
    client.completions.create(**ask)
    assert client.completions.create(**ask).usage.prompt_tokens_details.cached_tokens > 0
    opted_out = client.completions.create(**ask, extra_body={"cache_prompt": False}).usage
    assert opted_out.prompt_tokens_details.cached_tokens == 0 and opted_out.cairn["resume_position"] == 0


def test_concurrent_clients_each_get_their_own_output(client):
    """8 requests at once, each with its own prompt length and max_tokens: every caller gets its own."""
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            results[i] = client.completions.create(model=MODEL, prompt="x" * (i + 1), max_tokens=i + 1,
                                                   extra_body={"ignore_eos": True})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 8
    for i, r in results.items():
        assert r.usage.prompt_tokens == i + 1 and r.usage.completion_tokens == i + 1
    assert len({r.id for r in results.values()}) == 8


def test_metrics_expose_requests_tokens_latency_and_pools(http, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=2, extra_body={"ignore_eos": True})
    text = http.get("/metrics").text
    assert re.search(r'^cairn_requests_total\{endpoint="/v1/completions",status="200"\} [1-9]', text, re.M)
    for name in ("cairn_prompt_tokens_total", "cairn_generation_tokens_total", "cairn_computed_prompt_tokens_total",
                 "cairn_time_to_first_token_seconds_count", "cairn_inter_token_latency_seconds_count"):
        assert metric(http, name) > 0, name
    for name in ("cairn_num_requests_running", "cairn_num_requests_waiting", "cairn_kv_pages_free",
                 'cairn_pool_used_bytes{pool="kv"}', 'cairn_pool_capacity_bytes{pool="state"}'):
        assert metric(http, name) >= 0, name


def test_streamed_completion_logprobs_equal_the_whole_response_ones(http):
    """Legacy logprobs in a stream: each chunk carries its tokens' logprobs with text offsets counted
    from the choice's start, so that the chunks put together are the whole response's logprobs."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert len(pieces) > 1
    joined = {k: [v for p in pieces for v in p[k]] for k in whole}
    assert joined["tokens"] == whole["tokens"] and joined["text_offset"] == whole["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-4)  # (the second may
    #   resume from the first's cached prefix: equal within rounding)
    for got, want in zip(joined["top_logprobs"], whole["top_logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_logprobs_of_a_character_split_over_byte_tokens_give_each_token_its_bytes_and_offset(http):
    """A JSON-schema enum makes the demo model write "é" (chat) and "é€" (completions), one byte token per
    UTF-8 byte: each token reports its own byte, streamed or not, and the text offsets count the characters
    decoded before each token."""
    enum = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": ["é"]}}}
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "response_format": enum,
                                                    "logprobs": True, "top_logprobs": 1, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == '"é"'
    assert [t["bytes"] for t in chat["choices"][0]["logprobs"]["content"]] == [[34], [195], [169], [34]]
    enum["json_schema"]["schema"]["enum"] = ["é€"]
    body = {"model": MODEL, "prompt": "hi", "response_format": enum, "logprobs": 1, "temperature": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == '"é€"' and whole["logprobs"]["text_offset"] == [0, 1, 1, 2, 2, 2, 3]
    assert whole["logprobs"]["tokens"][1:3] == ["bytes:\\xc3", "bytes:\\xa9"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(e) for e in sse_events(r.iter_lines())[:-1]]
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for p in pieces for t in p["tokens"]] == whole["logprobs"]["tokens"]
    assert [o for p in pieces for o in p["text_offset"]] == whole["logprobs"]["text_offset"]
