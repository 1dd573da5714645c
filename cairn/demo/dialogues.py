"""Generated conversations in the demo model's chat template: tool loops, tool choice, reasoning, JSON, edits.

Each generator takes a `random.Random` and the standard-library material of `cairn.demo.sources` and
returns a `Dialogue`: chat messages in the OpenAI shape (tool calls with their arguments as dicts),
the tools offered, and whether the final reply opens with reasoning (`enable_thinking`). `render`
turns one into text with the template cairn's demo tokenizer uses, so the model learns exactly the
format the server renders and parses:

- agent episodes over a small file system (`FILE_TOOLS`: list a directory, read a file, write a
  file): list, read, summarise a directory into a file, rename a function, copy, create; several tasks
  to a conversation, each call answered by its tool's result, the way an agent client drives a model;
- tool choice among generated tools (weather, arithmetic, lookups, ...), arguments copied from the request;
- questions on the standard library's functions, answered from their docstrings; JSON answers;
  file-editing turns that copy a function and change one name; small talk and sums.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

from cairn.demo.sources import ApiDoc, Snippet
from cairn.request.tokenizer import DEMO_CHAT_TEMPLATE, compile_template

WORDS = (
    "alpha", "amber", "apple", "atlas", "birch", "cedar", "cobalt", "comet", "coral", "delta", "ember", "falcon",
    "fern", "garnet", "harbor", "hazel", "indigo", "iris", "jade", "juniper", "kestrel", "lark", "lemon", "linen",
    "maple", "meadow", "mint", "nova", "oak", "olive", "onyx", "orchid", "pearl", "pepper", "pine", "plum", "quartz",
    "raven", "river", "ruby", "sage", "salt", "shale", "silver", "spruce", "stone", "tide", "topaz", "violet",
    "willow", "zephyr", "budget", "notes", "plan", "draft", "report", "todo", "ideas", "summary", "letter", "list",
    "config", "readme", "changes", "agenda", "minutes", "recipe", "journal", "invoice", "schedule",
)
DIRS = ("docs", "notes", "src", "data", "reports", "drafts", "logs", "ideas", "letters", "archive", "work", "inbox",
        "project", "papers", "scripts", "tmp", "backup", "shared", "site", "books")
CITIES = ("Paris", "Lisbon", "Tokyo", "Nairobi", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Quito", "Seoul",
          "Dublin", "Madrid", "Prague", "Sydney", "Toronto", "Vienna", "Warsaw", "Athens", "Berlin", "Chicago",
          "Delhi", "Havana", "Jakarta", "Kyoto", "Lagos", "Manila", "Mumbai", "Rome", "Santiago")
SKIES = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowing", "clear", "stormy")
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Dutch", "Swedish", "Polish")
ZONES = ("UTC", "Europe/Paris", "Asia/Tokyo", "America/New_York", "Africa/Nairobi", "Australia/Sydney")
SYMBOLS = ("ACME", "GLOBX", "INITECH", "UMBRL", "WAYNE", "STARK", "TYRELL", "CYBER")
ASSISTANT_SYSTEMS = ("You are a helpful assistant.", "You are cairn's demo model, a small assistant.",
                     "You are a coding agent. Use the tools to work with files.", "Answer briefly.")


def _tool(name: str, description: str, params: dict[str, tuple[str, str]]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {k: {"type": t, "description": d} for k, (t, d) in params.items()},
                       "required": list(params)}}}


FILE_TOOLS = (
    _tool("list_directory", "List the names of the files in a directory, one per line.",
          {"path": ("string", "the directory")}),
    _tool("read_file", "Read a text file and return its contents.", {"path": ("string", "the file to read")}),
    _tool("write_file", "Write text to a file, replacing what it held.",
          {"path": ("string", "the file to write"), "content": ("string", "the text to write")}),
)


@dataclass
class Dialogue:
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    enable_thinking: bool | None = None  # None: the template's default (no reasoning block opened)


def call(function: str, /, **arguments) -> dict:
    return {"type": "function", "function": {"name": function, "arguments": arguments}}


def assistant(content: str = "", calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    m = re.match(r"(.+?[.!?])(\s|$)", line)
    return (m.group(1) if m else line)[:160]


class World:
    """The standard-library material and the random choices of one corpus part (training or held-out)."""

    def __init__(self, rng: random.Random, docs: list[ApiDoc], snippets: list[Snippet]):
        self.rng, self.docs, self.snippets = rng, docs, snippets

    def pick(self, seq):
        return self.rng.choice(seq)

    def sentence(self) -> str:
        return self.pick(self.docs).summary

    def file_name(self, ext: str | None = None) -> str:
        ext = ext or self.pick((".txt", ".txt", ".md", ".py"))
        stem = self.pick(WORDS) if self.rng.random() < 0.6 else f"{self.pick(WORDS)}_{self.pick(WORDS)}"
        if self.rng.random() < 0.2:
            stem += str(self.rng.randint(1, 9))
        return stem + ext

    def file_text(self, name: str) -> str:
        if name.endswith(".py"):
            return self.pick(self.snippets).source + "\n"
        return "\n".join(self.sentence() for _ in range(self.rng.randint(1, 3))) + "\n"

    def directory(self) -> tuple[str, dict[str, str]]:
        path = self.pick(DIRS)
        if self.rng.random() < 0.3:
            path += "/" + self.pick(DIRS)
        names: list[str] = []
        while len(names) < self.rng.randint(1, 4):
            name = self.file_name()
            if name not in names:
                names.append(name)
        return path, {name: self.file_text(name) for name in sorted(names)}


# ---- agent episodes over the file tools -------------------------------------------------------------------------

def _describe_file(name: str, text: str) -> str:
    if name.endswith(".py"):
        m = re.search(r"def (\w+)", text)
        return f"it defines the function `{m.group(1)}`" if m else "it holds Python code"
    return f"it says: {_first_sentence(text)}"


def _task_list(w: World, msgs: list[dict], think: bool) -> None:
    path, files = w.directory()
    ask = w.pick(("List the files in `{p}`.", "What files are in {p}?", "Show me what is in the {p} directory.",
                  "Which files does `{p}` hold?", "ls {p}"))
    msgs.append({"role": "user", "content": ask.format(p=path)})
    msgs.append(assistant(calls=[call("list_directory", path=path)],
                          reasoning=f"The user wants the files in `{path}`. I list that directory." if think else None))
    msgs.append({"role": "tool", "content": "\n".join(files)})
    names = [f"`{n}`" for n in files]
    msgs.append(assistant(f"`{path}` holds {len(files)} file{'s' if len(files) > 1 else ''}: {_and(names)}."))


def _task_read(w: World, msgs: list[dict], think: bool) -> None:
    path, files = w.directory()
    name = w.pick(list(files))
    full = f"{path}/{name}"
    ask = w.pick(("Read `{f}` and tell me what it says.", "What is in {f}?", "Open {f}.",
                  "Can you read the file `{f}`?", "Show me {f}."))
    msgs.append({"role": "user", "content": ask.format(f=full)})
    msgs.append(assistant(calls=[call("read_file", path=full)],
                          reasoning=f"I need the contents of `{full}`, so I read it." if think else None))
    msgs.append({"role": "tool", "content": files[name]})
    msgs.append(assistant(f"I read `{full}`: {_describe_file(name, files[name])}"
                          + ("" if name.endswith(".txt") or name.endswith(".md") else ".")))


def _task_summarise(w: World, msgs: list[dict], think: bool) -> None:
    path, files = w.directory()
    out = w.pick(("summary.txt", "index.md", "notes/summary.md", "overview.txt", f"{path}_summary.txt"))
    ask = w.pick(("Read every file in `{p}` and write a one-line summary of each to `{o}`.",
                  "Summarise the files in {p} into {o}.", "Go through {p} and put a summary of each file in {o}."))
    msgs.append({"role": "user", "content": ask.format(p=path, o=out)})
    msgs.append(assistant(calls=[call("list_directory", path=path)],
                          reasoning=f"First I list `{path}` to see its files." if think else None))
    msgs.append({"role": "tool", "content": "\n".join(files)})
    names = list(files)
    for i, name in enumerate(names):
        why = (f"`{path}` holds {len(names)} files. I read `{name}` first." if i == 0
               else f"I have read `{names[i - 1]}`. Next is `{name}`.")
        msgs.append(assistant(calls=[call("read_file", path=f"{path}/{name}")], reasoning=why if think else None))
        msgs.append({"role": "tool", "content": files[name]})
    summary = "\n".join(f"{name}: {_describe_file(name, text)}" for name, text in files.items()) + "\n"
    msgs.append(assistant(calls=[call("write_file", path=out, content=summary)],
                          reasoning=f"I have read all {len(names)} files. I write the summary to `{out}`." if think
                          else None))
    msgs.append({"role": "tool", "content": f"Wrote {len(summary.encode())} bytes to {out}."})
    msgs.append(assistant(f"I read the {len(names)} file{'s' if len(names) > 1 else ''} in `{path}` and wrote a "
                          f"one-line summary of each to `{out}`."))


def _task_rename(w: World, msgs: list[dict], think: bool) -> None:
    path = w.pick(DIRS)
    name = w.file_name(".py")
    source = w.pick(w.snippets).source + "\n"
    old = re.search(r"def (\w+)", source).group(1)
    new = w.pick(("new_", "do_", "get_", "make_")) + w.pick(WORDS)
    full = f"{path}/{name}"
    msgs.append({"role": "user", "content": w.pick((
        "In `{f}`, rename the function `{o}` to `{n}`.", "Rename {o} to {n} in {f}.")).format(f=full, o=old, n=new)})
    msgs.append(assistant(calls=[call("read_file", path=full)],
                          reasoning=f"I read `{full}` before I change it." if think else None))
    msgs.append({"role": "tool", "content": source})
    changed = re.sub(rf"\b{re.escape(old)}\b", new, source)
    msgs.append(assistant(calls=[call("write_file", path=full, content=changed)],
                          reasoning=f"I write `{full}` back with `{old}` renamed to `{new}`." if think else None))
    msgs.append({"role": "tool", "content": f"Wrote {len(changed.encode())} bytes to {full}."})
    msgs.append(assistant(f"Renamed `{old}` to `{new}` in `{full}`."))


def _task_create(w: World, msgs: list[dict], think: bool) -> None:
    full = f"{w.pick(DIRS)}/{w.file_name('.txt')}"
    text = w.sentence()
    ask = w.pick(("Create a file `{f}` that says: {t}", "Write \"{t}\" to {f}.", "Save this in {f}: {t}"))
    msgs.append({"role": "user", "content": ask.format(f=full, t=text)})
    msgs.append(assistant(calls=[call("write_file", path=full, content=text + "\n")],
                          reasoning=f"I write the text to `{full}`." if think else None))
    msgs.append({"role": "tool", "content": f"Wrote {len(text.encode()) + 1} bytes to {full}."})
    msgs.append(assistant(f"Created `{full}`."))


def _task_copy(w: World, msgs: list[dict], think: bool) -> None:
    path, files = w.directory()
    name = w.pick(list(files))
    src, dst = f"{path}/{name}", f"{w.pick(DIRS)}/{w.file_name(name[name.rindex('.'):])}"
    msgs.append({"role": "user", "content": w.pick(("Copy `{s}` to `{d}`.", "Make a copy of {s} at {d}.")).format(
        s=src, d=dst)})
    msgs.append(assistant(calls=[call("read_file", path=src)], reasoning=f"I read `{src}` first." if think else None))
    msgs.append({"role": "tool", "content": files[name]})
    msgs.append(assistant(calls=[call("write_file", path=dst, content=files[name])],
                          reasoning=f"Now I write the same text to `{dst}`." if think else None))
    msgs.append({"role": "tool", "content": f"Wrote {len(files[name].encode())} bytes to {dst}."})
    msgs.append(assistant(f"Copied `{src}` to `{dst}`."))


AGENT_TASKS = ((_task_summarise, 4), (_task_list, 2), (_task_read, 3), (_task_rename, 2), (_task_create, 1),
               (_task_copy, 1))


def agent_episode(w: World) -> Dialogue:
    tools = list(FILE_TOOLS)
    tools += w.rng.sample(GENERIC_TOOLS, w.rng.randint(0, 2))
    w.rng.shuffle(tools)
    think = w.rng.random() < 0.3
    msgs: list[dict] = []
    if w.rng.random() < 0.5:
        msgs.append({"role": "system", "content": w.pick(ASSISTANT_SYSTEMS)})
    tasks, weights = zip(*AGENT_TASKS, strict=True)
    for _ in range(w.rng.choice((1, 1, 2, 3))):
        w.rng.choices(tasks, weights)[0](w, msgs, think)
    return Dialogue(msgs, tools)


# ---- tool choice among generated tools --------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolUse:
    tool: dict
    make: object  # (World) -> (request, arguments, result, answer)


def _weather(w: World):
    city, temp, sky = w.pick(CITIES), w.rng.randint(-10, 38), w.pick(SKIES)
    ask = w.pick(("What's the weather in {c}?", "Is it cold in {c} today?", "How warm is it in {c}?",
                  "Weather for {c}, please."))
    return (ask.format(c=city), {"city": city}, json.dumps({"city": city, "temperature_c": temp, "sky": sky}),
            f"In {city} it is {temp} °C and {sky}.")


def _calculate(w: World):
    a, b = w.rng.randint(2, 999), w.rng.randint(2, 99)
    op, fn = w.pick((("+", a + b), ("-", a - b), ("*", a * b)))
    expr = f"{a} {op} {b}"
    ask = w.pick(("What is {e}?", "Compute {e}.", "Use the calculator: {e}", "How much is {e}?"))
    return ask.format(e=expr), {"expression": expr}, json.dumps({"result": fn}), f"{expr} = {fn}."


def _lookup(w: World):
    doc = w.pick(w.docs)
    ask = w.pick(("Look up `{m}.{n}` in the documentation.", "Find the docs of {m}.{n}.",
                  "What does the documentation say about `{m}.{n}`?"))
    return (ask.format(m=doc.module, n=doc.name), {"module": doc.module, "name": doc.name},
            json.dumps({"signature": doc.signature, "summary": doc.summary}),
            f"`{doc.module}.{doc.signature}`: {doc.summary}")


def _time(w: World):
    zone, h, m = w.pick(ZONES), w.rng.randint(0, 23), w.rng.randint(0, 59)
    ask = w.pick(("What time is it in {z}?", "Tell me the time in {z}.", "Current time, {z}?"))
    return ask.format(z=zone), {"timezone": zone}, json.dumps({"time": f"{h:02d}:{m:02d}"}), \
        f"It is {h:02d}:{m:02d} in {zone}."


def _translate(w: World):
    text, lang = w.pick(("good morning", "thank you", "where is the station", "see you tomorrow", "the bill, please",
                         "how are you")), w.pick(LANGUAGES)
    ask = w.pick(("Translate \"{t}\" into {l}.", "How do you say \"{t}\" in {l}?"))
    return ask.format(t=text, l=lang), {"text": text, "target_language": lang}, \
        json.dumps({"translation": f"[{lang}] {text}"}), f"In {lang}: [{lang}] {text}"


def _stock(w: World):
    sym, price = w.pick(SYMBOLS), round(w.rng.uniform(5, 900), 2)
    ask = w.pick(("What is {s} trading at?", "Price of {s} stock?", "Get me the share price of {s}."))
    return ask.format(s=sym), {"symbol": sym}, json.dumps({"symbol": sym, "price": price}), \
        f"{sym} is trading at {price}."


def _reminder(w: World):
    what, when = w.pick(("call the bank", "water the plants", "pay the rent", "send the report", "book a table")), \
        f"{w.rng.randint(7, 21):02d}:{w.pick(('00', '15', '30', '45'))}"
    ask = w.pick(("Remind me to {x} at {t}.", "Set a reminder at {t} to {x}."))
    return ask.format(x=what, t=when), {"text": what, "time": when}, json.dumps({"ok": True}), \
        f"I will remind you to {what} at {when}."


def _convert(w: World):
    value = w.rng.randint(1, 500)
    frm, to, factor = w.pick((("km", "miles", 0.621371), ("kg", "pounds", 2.20462), ("miles", "km", 1.609344),
                              ("liters", "gallons", 0.264172)))
    ask = w.pick(("Convert {v} {f} to {t}.", "How many {t} is {v} {f}?"))
    result = round(value * factor, 2)
    return ask.format(v=value, f=frm, t=to), {"value": value, "from_unit": frm, "to_unit": to}, \
        json.dumps({"result": result}), f"{value} {frm} is {result} {to}."


TOOL_USES = (
    ToolUse(_tool("get_weather", "Get the current weather in a city.", {"city": ("string", "the city")}), _weather),
    ToolUse(_tool("calculate", "Evaluate an arithmetic expression.",
                  {"expression": ("string", "the expression, e.g. 2 + 3")}), _calculate),
    ToolUse(_tool("lookup_docs", "Look up a function in the Python documentation.",
                  {"module": ("string", "the module"), "name": ("string", "the function")}), _lookup),
    ToolUse(_tool("get_time", "Get the current time in a time zone.", {"timezone": ("string", "an IANA zone")}), _time),
    ToolUse(_tool("translate", "Translate a text into another language.",
                  {"text": ("string", "the text"), "target_language": ("string", "the language")}), _translate),
    ToolUse(_tool("get_stock_price", "Get the latest price of a stock.", {"symbol": ("string", "the ticker")}),
            _stock),
    ToolUse(_tool("create_reminder", "Create a reminder.",
                  {"text": ("string", "what to remind"), "time": ("string", "HH:MM")}), _reminder),
    ToolUse(_tool("convert_units", "Convert a value between units.",
                  {"value": ("number", "the value"), "from_unit": ("string", "its unit"),
                   "to_unit": ("string", "the unit wanted")}), _convert),
)
GENERIC_TOOLS = [use.tool for use in TOOL_USES]


def tool_choice(w: World) -> Dialogue:
    """A request for one of 1-4 offered tools (sometimes beside the file tools), its call, result and answer."""
    uses = w.rng.sample(TOOL_USES, w.rng.randint(1, 4))
    tools = [u.tool for u in uses] + (list(FILE_TOOLS) if w.rng.random() < 0.25 else [])
    w.rng.shuffle(tools)
    think = w.rng.random() < 0.3
    msgs: list[dict] = []
    for _ in range(w.rng.choice((1, 1, 2))):
        use = w.pick(uses)
        request, arguments, result, answer = use.make(w)
        name = use.tool["function"]["name"]
        msgs.append({"role": "user", "content": request})
        msgs.append(assistant(calls=[call(name, **arguments)],
                              reasoning=f"The {name} tool answers this." if think else None))
        msgs.append({"role": "tool", "content": result})
        msgs.append(assistant(answer))
    if w.rng.random() < 0.2:  # a question no tool covers is answered directly
        msgs.extend(_doc_question(w))
    return Dialogue(msgs, tools)


# ---- conversations without tools --------------------------------------------------------------------------------

def _doc_question(w: World) -> list[dict]:
    doc = w.pick(w.docs)
    kind = w.rng.random()
    if kind < 0.6:
        ask = w.pick(("What does `{m}.{n}` do?", "Explain {m}.{n}.", "What is `{n}` in the `{m}` module for?",
                      "How do I use {m}.{n}?"))
        answer = f"`{doc.module}.{doc.signature}`: {doc.summary}"
    elif kind < 0.8:
        ask = w.pick(("Which module has the function `{n}`?", "Where is `{n}` defined?"))
        answer = f"`{doc.name}` is in the `{doc.module}` module: `{doc.module}.{doc.signature}`."
    else:
        ask = w.pick(("What are the parameters of `{m}.{n}`?", "Signature of {m}.{n}?"))
        answer = f"`{doc.module}.{doc.signature}`"
    return [{"role": "user", "content": ask.format(m=doc.module, n=doc.name)}, assistant(answer)]


def docs_chat(w: World) -> Dialogue:
    msgs: list[dict] = []
    if w.rng.random() < 0.4:
        msgs.append({"role": "system", "content": w.pick(ASSISTANT_SYSTEMS)})
    for _ in range(w.rng.randint(1, 4)):
        msgs.extend(_doc_question(w))
    return Dialogue(msgs)


def json_answer(w: World) -> Dialogue:
    doc = w.pick(w.docs)
    if w.rng.random() < 0.5:
        msgs = [{"role": "user", "content": f"Describe `{doc.module}.{doc.name}` as a JSON object with the keys "
                 "\"module\", \"name\" and \"summary\"."},
                assistant(json.dumps({"module": doc.module, "name": doc.name, "summary": doc.summary}))]
    else:
        msgs = [{"role": "system", "content": "Reply with a JSON object only."},
                {"role": "user", "content": f"Which module is `{doc.name}` from?"},
                assistant(json.dumps({"module": doc.module, "name": doc.name}))]
    return Dialogue(msgs)


def edit_turn(w: World) -> Dialogue:
    source = w.pick(w.snippets).source
    old = re.search(r"def (\w+)", source).group(1)
    new = w.pick(("new_", "do_", "get_", "make_")) + w.pick(WORDS)
    ask = w.pick(("Rename `{o}` to `{n}` in this function:", "Here is a function. Change its name from {o} to {n}."))
    changed = re.sub(rf"\b{re.escape(old)}\b", new, source)
    msgs = [{"role": "user", "content": ask.format(o=old, n=new) + f"\n\n```python\n{source}\n```"},
            assistant(f"```python\n{changed}\n```")]
    return Dialogue(msgs)


def small_talk(w: World) -> Dialogue:
    pairs = (
        ("Hello!", "Hello! I am cairn's demo model. How can I help?"),
        ("Hi, who are you?", "I am cairn's demo model: a small hybrid model, trained on a CPU, that can answer "
                             "questions about Python and use tools."),
        ("Thanks!", "You're welcome."),
        ("What can you do?", "I can answer questions about Python's standard library, call the tools you give me, "
                             "and read, write and summarise files."),
        ("Good morning.", "Good morning! What shall we work on?"),
        ("Tell me about cairn.", "cairn is a serving engine for hybrid language models. It caches the state of a "
                                 "conversation so that the next turn starts where the last one ended."),
    )
    msgs: list[dict] = []
    for _ in range(w.rng.randint(1, 3)):
        if w.rng.random() < 0.5:
            a, b = w.rng.randint(0, 50), w.rng.randint(0, 50)
            msgs += [{"role": "user", "content": w.pick(("What is {a} + {b}?", "{a} plus {b}?")).format(a=a, b=b)},
                     assistant(f"{a} + {b} = {a + b}.")]
        else:
            q, a = w.pick(pairs)
            msgs += [{"role": "user", "content": q}, assistant(a)]
    return Dialogue(msgs)


KINDS = ((agent_episode, 35), (tool_choice, 30), (docs_chat, 12), (json_answer, 8), (edit_turn, 7), (small_talk, 8))


def dialogue(w: World) -> Dialogue:
    kinds, weights = zip(*KINDS, strict=True)
    d = w.rng.choices(kinds, weights)[0](w)
    d.enable_thinking = w.pick((None, None, True, False)) if d.messages[-1]["role"] == "assistant" else None
    if d.enable_thinking is False:
        d.messages[-1].pop("reasoning_content", None)
    elif d.enable_thinking and not d.messages[-1].get("reasoning_content"):
        d.messages[-1]["reasoning_content"] = "I have what I need to answer."
    return d


_TEMPLATE = compile_template(DEMO_CHAT_TEMPLATE)
_LAST_TURN = "<|im_start|>assistant\n"


def render(d: Dialogue) -> str:
    """The dialogue as the demo template renders it, the last reply as it continues the generation prompt that
    `enable_thinking` asks for (an empty reasoning block for False)."""
    text = _TEMPLATE.render(messages=d.messages, tools=d.tools or None, add_generation_prompt=False)
    if d.enable_thinking is False:
        at = text.rindex(_LAST_TURN) + len(_LAST_TURN)
        text = text[:at] + "<think>\n\n</think>\n\n" + text[at:]
    return text


def render_prompt(messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool | None = None) -> str:
    """`messages` rendered as a prompt the model continues (the generation prompt appended), as the server does."""
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return _TEMPLATE.render(messages=messages, tools=tools or None, add_generation_prompt=True, **extra)
