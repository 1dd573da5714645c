"""Resume across a real server restart: serve a conversation, stop the server, start it again on the same
--disk-cache, send the conversation plus a new message: it resumes from disk and equals a cold run."""

from __future__ import annotations

import openai

from tests.server_process import start_server

FLAGS = ("--snapshot-interval", "64", "--page-size", "8")
CONVERSATION = [
    {"role": "system", "content": "You are terse. " + "Keep every answer short. " * 6},
    {"role": "user", "content": "List three colours of the sky at dusk, please."},
]


def chat(server, messages):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    return client.chat.completions.create(model="cairn-demo-random", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})


def test_conversation_resumes_from_disk_after_the_server_restarts(tmp_path):
    disk = ("--disk-cache", str(tmp_path))
    server = start_server(*FLAGS, *disk)
    try:
        first = chat(server, CONVERSATION)
    finally:
        assert server.stop() == 0
    follow_up = CONVERSATION + [{"role": "assistant", "content": first.choices[0].message.content},
                                {"role": "user", "content": "And at dawn?"}]
    server = start_server(*FLAGS, *disk)
    try:
        warm = chat(server, follow_up)
    finally:
        assert server.stop() == 0
    usage = warm.usage.model_dump()
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["cairn"]["tier"] == "disk"
    cold_server = start_server(*FLAGS, "--no-prefix-cache")
    try:
        cold = chat(cold_server, follow_up)
    finally:
        cold_server.stop()
    assert warm.choices[0].message.content == cold.choices[0].message.content
