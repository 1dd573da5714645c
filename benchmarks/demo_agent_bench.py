"""The agentic workload with turns the model writes: `PYTHONPATH=. python benchmarks/demo_agent_bench.py`.

`cairn bench`'s agentic session sends random text as the model's replies. Here the shipped demo model
(`cairn-demo`, float32) writes every turn: a file agent is given the three file tools (list a directory,
read a file, write a file) and a few tasks over a small made-up directory (from cairn.demo's held-out
material, so text the model never trained on); each call the model writes is parsed (cairn's own
Qwen3.5 XML parser), run on that in-memory file system, and its result sent back as a tool message, the
whole conversation resent each turn as an agent client does. The same session runs under several cache
policies (`cairn bench`'s, each on a fresh engine built the same way), one request at a time.

Printed: the CPU and cairn's CPU path; per policy the requests' table (prompt, cached, computed, what an
unlimited cache could reuse, resume point, time to first token); the share of each turn's prompt resumed,
turns after the first; and whether every policy's session got the same turns (warm == cold: the session
under `none`, no prefix cache, is the cold reference).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch

from cairn.bench.conversation import PRESETS, BenchRequest, Workload
from cairn.bench.engine_runner import EngineRunner
from cairn.bench.policies import LABELS, parse_names, policy_config
from cairn.bench.report import requests_table
from cairn.bench.run import run_workload
from cairn.config import DEMO_NAME, EngineConfig, config_with_overrides, environment_defaults
from cairn.demo import corpus
from cairn.demo.dialogues import FILE_TOOLS
from cairn.demo.train import cpu_name
from cairn.ops import cpu_isa
from cairn.server.chat.parsers import parse_call

MAX_TOKENS = 400  # per turn: a write of a summary of four files fits
MAX_TURNS = 10  # per task: a task still calling tools after this many turns is cut
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in FILE_TOOLS}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def split_reply(text: str) -> tuple[dict, list[tuple[str, dict]]]:
    """A reply as the assistant message a client sends back (reasoning, content, the well-formed calls of offered
    tools, as cairn's server returns them) and those calls."""
    reasoning = None
    if "</think>" in text:
        reasoning, text = text.split("</think>", 1)
        reasoning = reasoning.replace("<think>", "", 1).strip()
    calls = []
    for block in _CALL.findall(text):
        parsed = parse_call(block, SCHEMAS, complete=True)
        if parsed is not None:
            calls.append((parsed.name, json.loads(parsed.arguments)))
    content = _CALL.sub("", text).strip() if calls else text.strip()
    message: dict = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                                 for i, (name, args) in enumerate(calls)]
    return message, calls


def run_tool(files: dict[str, str], name: str, args: dict) -> str:
    """The file tools on an in-memory file system (path -> text); bad arguments are an error the model reads."""
    path = str(args.get("path", "")).strip("/")
    if name == "list_directory":
        names = sorted(p[len(path) + 1:] for p in files if p.startswith(path + "/") and "/" not in p[len(path) + 1:])
        return "\n".join(names) if names else f"error: no directory {path}"
    if name == "read_file":
        return files.get(path, f"error: no file {path}")
    content = str(args.get("content", ""))
    files[path] = content
    return f"Wrote {len(content.encode())} bytes to {path}."


def session(seed: int) -> tuple[dict[str, str], list[str]]:
    """The directory the agent works on and its tasks, from the held-out material."""
    w = corpus.world(seed, "held_out")
    path, listing = w.directory()
    while len(listing) < 3:
        path, listing = w.directory()
    files = {f"{path}/{name}": text for name, text in listing.items()}
    first = sorted(listing)[0]
    tasks = [f"Read every file in `{path}` and write a one-line summary of each to `summary.txt`.",
             f"What is in {path}/{first}?",
             f"Copy `{path}/{first}` to `backup/{first}`."]
    return files, tasks


def agentic_demo(seed: int, replies: list[str]) -> Workload:
    """The session as a workload; each reply's text is appended to `replies`."""

    def build(sizes, text, tokenizer):
        files, tasks = session(seed)
        messages: list[dict] = []
        for t, task in enumerate(tasks):
            messages.append({"role": "user", "content": task})
            for turn in range(MAX_TURNS):
                reply = yield BenchRequest(f"task {t} turn {turn}", list(messages), MAX_TOKENS, tools=list(FILE_TOOLS),
                                           until_end_of_turn=True)
                replies.append(reply.text)
                message, calls = split_reply(reply.text)
                messages.append(message)
                if not calls:
                    break
                for i, (name, args) in enumerate(calls):
                    result = run_tool(files, name, args)
                    messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": result})
    return Workload("agentic_demo", build)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="none,last_chunk,cairn", help="cache policies, comma-separated")
    p.add_argument("--seed", type=int, default=3, help="the held-out directory and its tasks")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    policies = parse_names(args.policies, list(LABELS), "--policies")
    flags = cpu_isa.cpu_flags()
    has = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    path = cpu_isa.described(cpu_isa.choose("auto", flags), "auto", flags)
    print(f"machine: {cpu_name()} ({', '.join(has)}); {path}; {torch.get_num_threads()} threads; model {DEMO_NAME}, "
          f"dtype {args.dtype}", flush=True)
    base = config_with_overrides(EngineConfig(), **environment_defaults(), model=DEMO_NAME, dtype=args.dtype)
    turns = {}
    for policy in policies:
        started = time.perf_counter()
        turns[policy] = []
        config = policy_config(base, policy)
        result = run_workload(agentic_demo(args.seed, turns[policy]), policy, lambda c=config: EngineRunner(c),
                              PRESETS["smoke"], 0)
        print(f"\n{requests_table(result)}\n({time.perf_counter() - started:.0f} s)", flush=True)
        later = result.requests[1:]
        if later:
            share = sum(x.cached_tokens for x in later) / sum(x.prompt_tokens for x in later)
            lowest = min(x.cached_tokens / x.prompt_tokens for x in later)
            print(f"{LABELS[policy]}: the turns after the first resumed {100 * share:.1f}% of their prompts "
                  f"(the lowest {100 * lowest:.1f}%)", flush=True)
    reference = turns.get("none")
    if reference is not None:
        for policy in policies:
            print(f"{LABELS[policy]}: {len(turns[policy])} turns, "
                  f"{'the same turns as no cache' if turns[policy] == reference else 'turns differ from no cache'}")


if __name__ == "__main__":
    main()
