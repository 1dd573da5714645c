"""Server parts without a server: request conversion, error mapping, the cache-stats collector, and
the engine thread's idle behaviour (with a fake engine)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cairn.cache.stats import CacheStats, DiskStats
from cairn.errors import ChatTemplateError, QueueFull, RequestTooLarge, SamplingError
from cairn.request.tokenizer import ByteTokenizer
from cairn.server.anthropic.request import MessagesRequest
from cairn.server.engine_io.bridge import EngineBridge
from cairn.server.errors import APIError, EngineFailure, ServerShuttingDown, from_exception
from cairn.server.metrics import EngineStats, cache_families
from cairn.server.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from cairn.server.openai.response_bodies import TextOffsets, chat_logprobs, completion_logprobs

CHAT = [{"role": "user", "content": "hi"}]


# ---- request conversion -------------------------------------------------------------------------

def test_cache_prompt_false_reaches_sampling_params():
    assert CompletionRequest(prompt="a", cache_prompt=False).to_sampling_params().cache_prompt is False
    assert CompletionRequest(prompt="a").to_sampling_params().cache_prompt is True


def test_max_completion_tokens_takes_precedence_over_max_tokens():
    req = ChatCompletionRequest(messages=CHAT, max_tokens=5, max_completion_tokens=7)
    assert req.to_sampling_params(context_fill_tokens=100).max_tokens == 7


def test_chat_without_max_tokens_asks_for_the_context_fill():
    req = ChatCompletionRequest(messages=CHAT)
    assert req.requested_max_tokens is None and req.to_sampling_params(context_fill_tokens=100).max_tokens == 100


def test_completion_max_tokens_defaults_to_16():
    assert CompletionRequest(prompt="a").to_sampling_params().max_tokens == 16


def test_sampling_fields_map_one_to_one():
    p = ChatCompletionRequest(messages=CHAT, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3, stop="x",
                              ignore_eos=True, logprobs=True, top_logprobs=3, user="u").to_sampling_params(10)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop) == (0.5, 0.9, 40, 0.05, 3, ("x",))
    assert p.ignore_eos and p.logprobs and p.top_logprobs == 3 and p.extra == {"user": "u"}


def test_stop_may_be_a_list():
    assert CompletionRequest(prompt="a", stop=["x", "yz"]).to_sampling_params().stop == ("x", "yz")


def test_text_parts_are_joined_by_newlines_and_other_parts_refused():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": parts, "name": "n"}])
    assert req.template_messages() == [{"role": "user", "content": "a\nb", "name": "n"}]
    bad = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "input_audio"}]}])
    with pytest.raises(APIError) as e:
        bad.template_messages()
    assert e.value.status == 400 and e.value.param == "messages.0.content.0"


def test_single_prompt_lists_are_unwrapped_and_batches_refused():
    assert CompletionRequest(prompt=["abc"]).engine_prompt() == "abc"
    assert CompletionRequest(prompt=[[1, 2]]).engine_prompt() == [1, 2]
    assert CompletionRequest(prompt=[1, 2]).engine_prompt() == [1, 2]
    with pytest.raises(APIError):
        CompletionRequest(prompt=["a", "b"]).engine_prompt()


@pytest.mark.parametrize("model,fields", [(ChatCompletionRequest, {"messages": CHAT}),
                                          (CompletionRequest, {"prompt": "a"})])
def test_stream_options_without_stream_is_refused_naming_it(model, fields):
    for stream in ({}, {"stream": False}):
        with pytest.raises(APIError) as e:
            model.model_validate({**fields, **stream, "stream_options": {"include_usage": True}})
        assert (e.value.status, e.value.param) == (400, "stream_options")
    assert model.model_validate({**fields, "stream": True, "stream_options": {"include_usage": True}}).include_usage


NULLABLE = ("n", "stream", "stream_options", "ignore_eos", "cache_prompt", "return_token_ids", "min_tokens",
            "include_stop_str_in_output", "echo", "max_tokens", "temperature", "stop", "seed", "response_format")


@pytest.mark.parametrize("model,fields,nullable", [
    (ChatCompletionRequest, {"messages": CHAT}, NULLABLE + ("logprobs", "top_logprobs", "parallel_tool_calls",
                                                            "max_completion_tokens", "tools", "tool_choice")),
    (CompletionRequest, {"prompt": "a"}, NULLABLE + ("logprobs", "message_starts")),
])
def test_null_for_an_optional_field_means_its_default(model, fields, nullable):
    """Wrappers (LangChain, LiteLLM) send null for the fields they leave unset: it reads as the field left
    out, while a value of the wrong type is still refused and null for a required field too."""
    given = model.model_validate({**fields, **dict.fromkeys(nullable)})
    assert given == model.model_validate(fields)
    streamed = model.model_validate({**fields, "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.include_usage is False
    for wrong in ("2", 2.5):
        with pytest.raises(ValueError, match="valid integer"):
            model.model_validate({**fields, "n": wrong})
    with pytest.raises(ValueError):
        model.model_validate(dict.fromkeys(fields))


@pytest.mark.parametrize("model,body,param", [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800 x"}]},
     "messages.1.content"),
    (ChatCompletionRequest, {"messages": CHAT, "stop": ["a", "\udfff"]}, "stop.1"),
    (CompletionRequest, {"prompt": "\ud800 lone"}, "prompt"),
    (TokenizeRequest, {"prompt": "\ud800 lone"}, "prompt"),
    (MessagesRequest, {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\ud800"}]}]}, "messages.0.content.0.text"),
])
def test_a_lone_surrogate_in_the_body_is_refused_naming_its_field(model, body, param):
    """JSON's `\\ud800` escape without its pair is not Unicode text: a 400 names where it is, instead of the
    tokenizer's UTF-8 error naming nothing. A pair (one character) is text."""
    with pytest.raises(APIError) as e:
        model.model_validate(body)
    assert (e.value.status, e.value.param) == (400, param) and "lone UTF-16 surrogate" in e.value.message
    assert CompletionRequest.model_validate(json.loads('{"prompt": "\\ud83d\\ude00"}')).prompt == "\U0001F600"


@pytest.mark.parametrize("fields", [{"echo": True}, {"best_of": 3}])
def test_unsupported_options_are_refused_not_ignored(fields):
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="a", **fields).to_sampling_params()
    assert e.value.status == 400 and e.value.code == "unsupported_value"


@pytest.mark.parametrize("suffix", [None, ""])
def test_an_empty_suffix_is_neutral_and_accepted_and_a_real_one_refused(suffix):
    """suffix: "" appends nothing, as null does (it was a 400); any other text is refused, not ignored."""
    assert CompletionRequest.model_validate({"prompt": "a", "suffix": suffix}).prompt == "a"
    with pytest.raises(APIError) as e:
        CompletionRequest.model_validate({"prompt": "a", "suffix": "tail"})
    assert (e.value.status, e.value.param) == (400, "suffix")


@pytest.mark.parametrize("modalities", [None, ["text"]])
def test_text_output_modalities_are_neutral_and_accepted_and_audio_refused(modalities):
    """modalities: ["text"] (OpenAI's default, which clients send) asks for the text cairn writes (it was a
    400); asking for audio too is refused, not ignored."""
    body = {"messages": [{"role": "user", "content": "a"}], "modalities": modalities}
    assert ChatCompletionRequest.model_validate(body).messages[0].content == "a"
    with pytest.raises(APIError) as e:
        ChatCompletionRequest.model_validate({**body, "modalities": ["text", "audio"]})
    assert (e.value.status, e.value.param) == (400, "modalities")


# ---- what a request may not carry silently --------------------------------------------------------

def _refusal(make, *args) -> APIError:
    with pytest.raises(APIError) as e:
        make(*args)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("kind", ["text", "json_object"])
def test_a_json_schema_beside_a_response_format_type_that_does_not_read_it_is_refused(kind):
    schema = {"name": "x", "schema": {"type": "object"}}
    req = ChatCompletionRequest(messages=CHAT, response_format={"type": kind, "json_schema": schema})
    assert _refusal(req.to_sampling_params, 10).param == "response_format.json_schema"


def test_a_text_part_with_a_key_beside_type_text_and_cache_control_is_refused_naming_it():
    part = {"type": "text", "text": "hi", "foo": {"type": "ephemeral"}}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [part]}])
    error = _refusal(req.template_messages)
    assert (error.param, error.code) == ("messages.0.content.0.foo", "unknown_field")


@pytest.mark.parametrize("mark, param", [({"type": "persistent"}, "cache_control.type"),
                                         ({"type": "ephemeral", "ttl": "2h"}, "cache_control.ttl"),
                                         ("ephemeral", "cache_control")])
def test_a_text_parts_cache_control_of_another_type_or_ttl_is_refused_naming_it(mark, param):
    part = {"type": "text", "text": "hi", "cache_control": mark}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [part]}])
    error = _refusal(req.template_messages)
    assert (error.param, error.code) == (f"messages.0.content.0.{param}", "invalid_value")


def test_a_text_part_without_its_text_is_refused_saying_the_text_is_missing():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text"}]}])
    error = _refusal(req.template_messages)
    assert (error.param, error.code) == ("messages.0.content.0.text", "missing_field")
    assert "needs its text" in error.message and "not supported" not in error.message


CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


@pytest.mark.parametrize("message,field", [
    ({"role": "user", "content": "x", "tool_calls": CALL}, "tool_calls"),
    ({"role": "tool", "content": "x", "tool_call_id": "c1", "tool_calls": CALL}, "tool_calls"),
    ({"role": "user", "content": "x", "tool_call_id": "c1"}, "tool_call_id"),
    ({"role": "assistant", "content": "x", "tool_call_id": "c1"}, "tool_call_id"),
    ({"role": "system", "content": "x", "reasoning_content": "r"}, "reasoning_content"),
    ({"role": "assistant", "content": "x", "reasoning_content": "r", "reasoning": "r"}, "reasoning"),
])
def test_a_message_field_its_role_does_not_use_or_the_reasoning_twice_is_refused_naming_it(message, field):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}, message])
    assert _refusal(req.template_messages).param == f"messages.1.{field}"
    ok = [{"role": "assistant", "content": "", "tool_calls": CALL, "reasoning": "r"},
          {"role": "tool", "content": "x", "tool_call_id": "c1"}]
    assert len(ChatCompletionRequest(messages=ok).template_messages()) == 2


@pytest.mark.parametrize("model,fields", [(ChatCompletionRequest, {"messages": CHAT}),
                                          (TokenizeRequest, {"messages": CHAT})])
def test_two_tools_with_the_same_function_name_are_refused_naming_the_second(model, fields):
    tools = [{"type": "function", "function": {"name": name}} for name in ("f", "g", "f")]
    assert _refusal(model.model_validate, {**fields, "tools": tools}).param == "tools.2.function.name"


# ---- logprobs -----------------------------------------------------------------------------------

EURO_E = "é€".encode()  # five byte tokens of the demo tokenizer, none a whole character


def test_logprobs_of_a_character_split_over_byte_tokens_give_each_token_its_own_bytes():
    tok = ByteTokenizer()
    content = chat_logprobs(tok, [195, 169], [-1.0, -2.0], [[(195, -1.0), (196, -3.0)], [(169, -2.0)]])["content"]
    assert [(t["token"], t["bytes"]) for t in content] == [("bytes:\\xc3", [195]), ("bytes:\\xa9", [169])]
    assert [(t["token"], t["bytes"]) for t in content[0]["top_logprobs"]] == [("bytes:\\xc3", [195]),
                                                                             ("bytes:\\xc4", [196])]
    whole = completion_logprobs(tok, list(EURO_E), [-1.0] * 5, [[(b, -1.0)] for b in EURO_E], TextOffsets())
    assert whole["tokens"] == ["bytes:\\xc3", "bytes:\\xa9", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac"]
    assert len(set(k for top in whole["top_logprobs"] for k in top)) == 5


def test_completion_text_offsets_count_the_characters_decoded_before_each_token_across_stream_chunks():
    """An offset is where its token starts in the answer's text: a token ending a character starts where
    the character does. Chunks of a stream, fed one after the other, give the whole answer's offsets."""
    tok, ids = ByteTokenizer(), [ord('"'), *EURO_E, ord('"')]
    whole = completion_logprobs(tok, ids, [-1.0] * 7, [], TextOffsets())["text_offset"]
    assert whole == [0, 1, 1, 2, 2, 2, 3]
    for cut in range(1, len(ids)):
        offsets = TextOffsets()
        chunks = [completion_logprobs(tok, part, [-1.0] * len(part), [], offsets)["text_offset"]
                  for part in (ids[:cut], ids[cut:])]
        assert chunks[0] + chunks[1] == whole, cut


def test_completion_top_logprobs_keep_alternatives_that_share_a_text():
    class OneText(ByteTokenizer):
        def token_bytes(self, token_id: int) -> bytes:
            return b"x"

    tops = completion_logprobs(OneText(), [1], [-1.0], [[(1, -1.0), (2, -2.0)]], TextOffsets())["top_logprobs"]
    assert tops == [{"x": -1.0, "token_id:2": -2.0}]


# ---- error mapping ------------------------------------------------------------------------------

@pytest.mark.parametrize("exc,status,code", [
    (QueueFull("9 waiting"), 429, "queue_full"),
    (RequestTooLarge("prompt has 9 tokens; this model's context is 8 tokens"), 400, "context_length_exceeded"),
    (RequestTooLarge("the prompt is empty"), 400, "invalid_value"),
    (SamplingError("top_p must be in (0, 1]"), 400, "invalid_value"),
    (ChatTemplateError("bad roles"), 400, "invalid_value"),
    (ValueError("request id in use"), 400, "invalid_value"),
    (ServerShuttingDown("bye"), 503, "shutting_down"),
    (EngineFailure("boom"), 500, "internal_error"),
    (KeyError("x"), 500, "internal_error"),
])
def test_engine_errors_map_to_openai_statuses(exc, status, code):
    error = from_exception(exc)
    assert (error.status, error.code) == (status, code)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_sampling_error_names_its_parameter():
    assert from_exception(SamplingError("top_p must be in (0, 1]")).param == "top_p"


# ---- cache stats ----------------------------------------------------------------------------------

def _exposition(stats) -> str:
    registry = CollectorRegistry()

    class Fixed:
        def collect(self):
            return cache_families(stats)

    registry.register(Fixed())
    return generate_latest(registry).decode()


def test_cache_stats_become_counters_gauges_and_labelled_families():
    text = _exposition(CacheStats(counters={"snapshots_taken": 12, "snapshots_restored": 5},
                                  dropped_by_reason={"evicted": 3, "kv_evicted": 1},
                                  snapshots_per_tier={"device": 7}, snapshot_used_bytes={"device": 4096}))
    assert "cairn_cache_snapshots_taken_total 12.0" in text
    assert "cairn_cache_snapshots_restored_total 5.0" in text
    assert 'cairn_cache_snapshots_dropped_total{reason="evicted"} 3.0' in text
    assert 'cairn_cache_snapshots_dropped_total{reason="kv_evicted"} 1.0' in text
    assert "# TYPE cairn_cache_num_snapshots gauge" in text and 'cairn_cache_num_snapshots{tier="device"} 7.0' in text
    assert "# TYPE cairn_cache_snapshot_used_bytes gauge" in text
    assert "cairn_cache_host_kv_used_bytes" not in text and "cairn_cache_disk" not in text  # no such tier


def test_every_cache_metric_keeps_the_name_and_label_it_had_with_string_keys():
    stats = CacheStats(counters={"kv_pages_evicted": 1}, taken_by_source={"grid": 1}, restored_by_tier={"host": 1},
                       dropped_by_reason={"evicted": 1}, tier_moves={"persisted": 1}, tier_drops={"kv_host_full": 1},
                       snapshots_per_tier={"disk": 1}, snapshot_used_bytes={"host": 1},
                       snapshot_budget_bytes={"host": 1}, num_tree_nodes=1, host_kv_used_bytes=1,
                       disk=DiskStats(1, 1, {"bad": 1}, {"disk_evicted": 1}, {"write_failed": 1}, {"puts": 1}, 2),
                       resume_failures={"evicted": 1}, pinned_bytes={"device": 1}, pins={"expired": 1})
    families = {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", _exposition(stats), re.M)}
    assert families == {
        "cairn_cache_kv_pages_evicted_total": "counter", "cairn_cache_snapshots_taken_by_total": "counter",
        "cairn_cache_snapshots_restored_from_total": "counter", "cairn_cache_snapshots_dropped_total": "counter",
        "cairn_cache_tier_moves_total": "counter", "cairn_cache_tier_drops_total": "counter",
        "cairn_cache_num_snapshots": "gauge", "cairn_cache_snapshot_used_bytes": "gauge",
        "cairn_cache_snapshot_budget_bytes": "gauge", "cairn_cache_num_tree_nodes": "gauge",
        "cairn_cache_host_kv_used_bytes": "gauge", "cairn_cache_disk_used_bytes": "gauge",
        "cairn_cache_num_disk_segments": "gauge", "cairn_cache_disk_faults_total": "counter",
        "cairn_cache_disk_segments_forgotten_total": "counter", "cairn_cache_disk_operations_total": "counter",
        "cairn_cache_disk_store_segments_total": "counter", "cairn_cache_resume_failures_total": "counter",
        "cairn_cache_disk_budget_bytes": "gauge", "cairn_cache_pinned_bytes": "gauge",
        "cairn_cache_pins_total": "counter"}
    labels = set(re.findall(r"^cairn_cache_(\w+)\{(\w+)=", _exposition(stats), re.M))
    assert labels == {("snapshots_taken_by_total", "source"), ("snapshots_restored_from_total", "tier"),
                      ("snapshots_dropped_total", "reason"), ("tier_moves_total", "kind"),
                      ("tier_drops_total", "reason"), ("num_snapshots", "tier"), ("snapshot_used_bytes", "tier"),
                      ("snapshot_budget_bytes", "tier"), ("disk_faults_total", "reason"),
                      ("disk_segments_forgotten_total", "reason"), ("disk_operations_total", "kind"),
                      ("disk_store_segments_total", "event"), ("resume_failures_total", "reason"),
                      ("pinned_bytes", "tier"), ("pins_total", "event")}


def test_null_cache_stats_export_nothing():
    assert "cairn_cache" not in _exposition(None)


def test_engine_stats_read_pool_usage_from_the_engine():
    class Pool:
        num_pages, num_slots, num_free, bytes_per_page, bytes_per_slot = 10, 4, 3, 100, 50
        allocator = type("A", (), {"num_free": 6})()

    class Engine:
        num_running, num_waiting, kv, states = 2, 1, Pool(), Pool()

        def cache_stats(self):
            return {"snapshots_taken": 1}

        def num_cached_pages(self):
            return 2

    engine = Engine()
    s = EngineStats.read(engine)
    assert (s.kv_pages_total, s.kv_pages_free, s.kv_pages_cached) == (10, 6, 2)
    assert (s.state_slots_free, s.cache) == (3, {"snapshots_taken": 1})


# ---- the engine thread ----------------------------------------------------------------------------

class IdleEngine:
    """Never has work; counts how often the bridge asks."""

    def __init__(self):
        self.num_polls = 0

    def has_unfinished(self) -> bool:
        self.num_polls += 1
        return False

    def stalled(self) -> None:
        return None

    def close(self) -> None:
        pass


def test_engine_thread_sleeps_while_idle_and_wakes_for_a_command():
    engine = IdleEngine()
    bridge = EngineBridge(engine)
    bridge.start()
    try:
        time.sleep(0.3)
        assert engine.num_polls <= 4  # no busy wait: a handful of checks in 0.3 s, not thousands
        seen = asyncio.run(bridge.call(lambda e: threading.current_thread().name))
        assert seen == "cairn-engine"
    finally:
        bridge.stop(timeout_s=5)
    assert not bridge.alive


class OneLongStep:
    """Has one step to run, which lasts until `release` is set (a long prefill on a CPU)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        self.busy, self.closed = True, False

    def has_unfinished(self) -> bool:
        return self.busy

    def stalled(self) -> None:
        return None

    def step(self) -> list:
        self.entered.set()
        self.release.wait(30)
        self.busy = False
        return []

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def inside_a_long_step() -> tuple[OneLongStep, EngineBridge, threading.Thread]:
    """A bridge whose engine is inside its long step, and a thread calling its stop(timeout_s=0.05)."""
    engine = OneLongStep()
    bridge = EngineBridge(engine)
    bridge.start()
    assert engine.entered.wait(10)
    stopper = threading.Thread(target=bridge.stop, args=(0.05,), daemon=True)
    stopper.start()
    return engine, bridge, stopper


def test_stop_waits_past_its_timeout_for_a_long_step_so_that_the_engine_closes_its_cache():
    """The lifespan gave the engine thread 5 s, then the process exited inside the step: engine.close()
    never ran, so the aborted requests' snapshots were not written through and the remote tier's queued
    writes were dropped. stop() now waits for the step to end."""
    engine, bridge, stopper = inside_a_long_step()
    try:
        stopper.join(0.5)
        still_waiting = stopper.is_alive()
    finally:
        engine.release.set()
    stopper.join(10)
    assert still_waiting and not stopper.is_alive()
    assert engine.closed and not bridge.alive


def test_a_hurried_stop_returns_inside_a_long_step_once_its_timeout_has_passed():
    """A second signal: the user wants the process gone now, whatever the step still holds."""
    engine, bridge, stopper = inside_a_long_step()
    try:
        bridge.hurry()
        stopper.join(10)
        assert not stopper.is_alive() and bridge.alive and not engine.closed
    finally:
        engine.release.set()
    bridge._thread.join(10)
    assert engine.closed


def test_a_developer_message_is_rendered_as_the_system_message_it_stands_for():
    """OpenAI's clients send instructions under role "developer"; the chat template sees role "system"."""
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert body.template_messages() == plain.template_messages()
    assert body.template_messages()[0] == {"role": "system", "content": "be brief"}


def test_an_api_error_made_by_keyword_survives_the_pickle_a_request_worker_sends_it_in():
    """A request worker raises errors to the server pickled. An exception pickles its positional arguments only,
    and one made by keyword (dataclasses.replace: the Anthropic route renaming a chat error's fields) had none:
    unpickling it raised TypeError in the server, and a large /v1/messages body got a 500 for a 400."""
    import dataclasses
    import pickle

    original = APIError(400, "tool_choice needs a name", param="tool_choice.name", code="invalid_value")
    renamed = dataclasses.replace(original, message="renamed", param="tool_choice")
    for e in (original, renamed, APIError(status=429, message="busy", headers={"Retry-After": "1"})):
        back = pickle.loads(pickle.dumps(e))
        assert (back.status, back.message, back.type, back.param, back.code, back.headers) == \
            (e.status, e.message, e.type, e.param, e.code, e.headers)


def test_prompt_cache_key_is_taken_on_chat_and_completions_bodies():
    """The router's routing key (cairn/router/affinity.py): a replica takes it, as the Responses route does."""
    assert ChatCompletionRequest(messages=CHAT, prompt_cache_key="session-1").prompt_cache_key == "session-1"
    assert CompletionRequest(prompt="hi", prompt_cache_key="session-1").prompt_cache_key == "session-1"
