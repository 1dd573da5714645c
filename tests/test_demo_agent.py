"""An agent loop against the trained demo model: the official `openai` client, three local file tools, a real
`cairn serve` (the command line's default model, `cairn-demo`, in its default float32).

The agent asks the model to summarise a directory into a file; every call the model writes is executed on a
temporary directory and its result (or the tool's error) sent back, as an agent client does. What must hold: the
model drives turns of well-formed calls of the offered tools on its own, starting by listing a directory (at
least MIN_CALLS); every turn after the first resumes from the cache at least MIN_RESUMED of its prompt, and all of
the turn before it (its prompt and its answer: what is new is the tools' results); and every turn's answer equals
the answer a server without a prefix cache gives to the same request (warm == cold).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import openai
import pytest

from cairn.config import DEMO_NAME
from tests.server_process import Served, start_server

TOOLS = [
    {"type": "function", "function": {"name": "list_directory", "description": "List the names of the files in a "
     "directory, one per line.", "parameters": {"type": "object", "properties": {
         "path": {"type": "string", "description": "the directory"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a text file and return its contents.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "the file to read"}},
                    "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write text to a file, replacing what it "
     "held.", "parameters": {"type": "object", "properties": {
         "path": {"type": "string", "description": "the file to write"},
         "content": {"type": "string", "description": "the text to write"}}, "required": ["path", "content"]}}},
]
FILES = {"budget.txt": "Return the sum of the values in the list.\n",
         "plan.md": "Write the data to the file and flush it.\nClose the connection.\n",
         "ideas.txt": "Split the string at the first separator.\n"}
MAX_TURNS = 8
# The shipped model (7.4 M training tokens) drives the loop on its own, a well-formed call of an offered tool each
# turn, starting by listing a directory; it does not yet copy the directory's name from the request.
MIN_CALLS = 5
MIN_RESUMED = 0.9  # of each later turn's prompt


@pytest.fixture(scope="module")
def servers():
    warm = Served(start_server("--model", DEMO_NAME, "--log-level", "WARNING"), 120.0)
    cold = Served(start_server("--model", DEMO_NAME, "--no-prefix-cache", "--log-level", "WARNING"), 120.0)
    yield warm, cold
    warm.close()
    cold.close()


def run_tool(root: Path, name: str, arguments: dict) -> str:
    """The three tools, on `root`; a path outside it is refused as a tool error the model reads."""
    path = (root / str(arguments.get("path", ""))).resolve()
    if not path.is_relative_to(root):
        return f"error: {arguments['path']} is outside the working directory"
    try:
        if name == "list_directory":
            return "\n".join(sorted(p.name for p in path.iterdir()))
        if name == "read_file":
            return path.read_text()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(arguments["content"]))
        return f"Wrote {len(str(arguments['content']).encode())} bytes to {arguments['path']}."
    except (OSError, KeyError) as e:
        return f"error: {type(e).__name__} on {arguments.get('path')}"


def ask(client: openai.OpenAI, messages: list[dict]):
    return client.chat.completions.create(model=DEMO_NAME, messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=400)


def said(reply) -> tuple:
    """What a reply says, without its ids: its text, its calls and why it stopped."""
    message = reply.choices[0].message
    calls = [(tc.function.name, tc.function.arguments) for tc in message.tool_calls or ()]
    return message.content, calls, reply.choices[0].finish_reason


def test_the_demo_model_runs_a_tool_loop_from_the_cache_and_warm_equals_cold(servers, tmp_path):
    warm, cold = servers
    (tmp_path / "notes").mkdir()
    for name, text in FILES.items():
        (tmp_path / "notes" / name).write_text(text)
    messages = [{"role": "user", "content": "Read every file in `notes` and write a one-line summary of each to "
                                            "`summary.txt`."}]
    calls, turns = [], []
    for _ in range(MAX_TURNS):
        reply = ask(warm.openai, messages)
        turns.append(reply)
        again = ask(cold.openai, messages)
        assert said(again) == said(reply), "warm != cold"
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for tc in message.tool_calls:
            arguments = json.loads(tc.function.arguments)
            calls.append((tc.function.name, arguments))
            messages.append({"role": "tool", "tool_call_id": tc.id,
                             "content": run_tool(tmp_path, tc.function.name, arguments)})
    names = [name for name, _ in calls]
    assert len(calls) >= MIN_CALLS and set(names) <= {"list_directory", "read_file", "write_file"}, calls
    assert names[0] == "list_directory", calls
    for before, reply in itertools.pairwise(turns):  # all of the turn before, its answer included, is resumed
        seen = before.usage.prompt_tokens + before.usage.completion_tokens - 1  # (the last token was never fed)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached >= seen and cached >= MIN_RESUMED * reply.usage.prompt_tokens, (before.usage, reply.usage)
