"""Message-start snapshots land at every message start of an agentic session whose assistant messages
carry reasoning and tool calls (the `agentic` bench workload, real tool-call messages), on the demo
model: a later request that shares the history up to any message start resumes exactly there; in
process and through a real `cairn serve`.
"""

from __future__ import annotations

from cairn.bench.conversation import Reply, WorkloadSizes
from cairn.bench.text import TextSource
from cairn.bench.workloads import all_workloads
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams
from cairn.request.tokenizer import ByteTokenizer
from tests.server_process import served_fixture

SIZES = WorkloadSizes(system_tokens=32, message_tokens=20, reply_tokens=2, compaction_context_tokens=320,
                      keep_fraction=0.55, instruction_tokens=8, agentic_turns=6, tool_result_tokens=20,
                      interleave_tokens=128, shared_fractions=(0.0,), edit_context_tokens=160, num_users=2,
                      user_tokens=16, restart_turns=4)
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def agentic_turn(turn: int) -> list[dict]:
    """The messages of the agentic workload's request `turn`, its assistant messages given reasoning."""
    tokenizer = ByteTokenizer()
    stream = all_workloads()["agentic"].build(SIZES, TextSource(0, tokenizer), tokenizer)
    request = next(stream)
    for _ in range(turn):
        request = stream.send(Reply("thinking... the answer"))
    return [{**m, "reasoning_content": f"why {i}"} if m["role"] == "assistant" else m
            for i, m in enumerate(request.messages)]


def test_agentic_workload_sends_real_tool_call_messages():
    messages = agentic_turn(3)
    calls = [m for m in messages if m["role"] == "assistant"]
    assert len(calls) == 3 and all(m["tool_calls"][0]["function"]["name"] == "run_command" for m in calls)
    results = [m for m in messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [m["tool_calls"][0]["id"] for m in calls]


def test_every_message_start_of_an_agentic_session_with_reasoning_and_tool_calls_is_a_resume_point():
    llm = LLM(kv_cache_gib=0.05, state_cache_gib=0.02, page_size=8, max_num_batched_tokens=96, max_num_seqs=4,
              device_snapshot_gib=0.1, snapshot_interval=1024)
    messages = agentic_turn(3)
    ids, ends = llm.engine.tokenize_chat(messages)
    text = llm.tokenizer.decode(ids)
    assert "<tool_call>\n<function=run_command>" in text and "<think>\nwhy 2\n</think>" in text
    llm.chat(messages, GREEDY)
    starts = ends[:-1]  # where messages[1:] start (the last entry is where the answer starts)
    assert len(starts) == len(messages) - 1
    im_start = llm.tokenizer.special_tokens["<|im_start|>"]
    for k, p in enumerate(starts, start=1):
        assert ids[p] == im_start, k  # a boundary of the rendered conversation
        out = llm.generate(ids[:p] + llm.tokenizer.encode("Zz"), GREEDY)[0]
        assert out.cache.match_length == p and out.cache.resume_position == p, (k, messages[k]["role"])


served = served_fixture("--max-model-len", "2048", "--max-num-seqs", "2", "--log-level", "WARNING")


def test_served_streamed_chat_with_reasoning_and_tool_calls_resumes_at_every_message_start(client, http):
    """The same through a real `cairn serve` and the openai client: the chat is streamed, then a token
    prompt that leaves the history right after each message start resumes exactly there."""
    messages = agentic_turn(3)
    rendered = http.post("/tokenize", json={"messages": messages}).json()
    ids, starts = rendered["tokens"], rendered["message_starts"]
    assert len(starts) == len(messages) + 1  # each message's start, and where the generation prompt starts
    chunks = list(client.chat.completions.create(model="cairn-demo-random", messages=messages, max_tokens=2,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert next(c.usage for c in chunks if c.usage).prompt_tokens == len(ids)
    branch = http.post("/tokenize", json={"prompt": "Zz"}).json()["tokens"]
    for k, p in enumerate(starts[1:], start=1):
        r = client.completions.create(model="cairn-demo-random", prompt=ids[:p] + branch, max_tokens=1, temperature=0)
        role = messages[k]["role"] if k < len(messages) else "generation prompt"
        assert r.usage.model_extra["cairn"]["resume_position"] == p, (k, role)
