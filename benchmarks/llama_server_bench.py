"""cairn's server against llama.cpp's `llama-server`, side by side, on the same random Qwen3.5 weights.

What it measures, each engine driven over loopback HTTP with the same token-id prompts, greedy (temperature 0),
one server running at a time:

    prefill    cold prefill tok/s of a PROMPT_TOKENS-token prompt (a new random prompt each repeat, the prefix
               cache not read: cairn `cache_prompt: false`, llama-server `cache_prompt: false`; one output
               token), timed at the client from send to answer
    decode     batch-1 and batch-8 decode tok/s (REPLY_TOKENS tokens per request, EOS ignored; batch 8: 8
               concurrent streams), counted over the window in which every stream has its first token and none
               has its last: tokens that arrived in it over its length
    patterns   six divergence patterns (append a turn, strip the previous reply's reasoning, compaction replay at
               60%, interleave A/B/A, one token edited at 50%, the next turn after a server restart): for the
               request each pattern ends with, the prompt tokens reused (cairn: usage.prompt_tokens_details.
               cached_tokens; llama-server: timings.cache_n), its time to first token, the same request's time
               to first token cold (cache not read) and whether the warm output equals the cold one (token ids)

Configurations (one server process each): `cairn` is `cairn serve --model DIR --dtype bfloat16` with default flags
(`cairn+disk` adds `--disk-cache`, patterns only); `llama` is `llama-server -m MODEL.gguf` with its default flags
(`-np 8` added for prefill / decode: 8 concurrent streams need 8 slots; the default is 4); `llama-bf16` the same on
the bf16 GGUF; `llama-generous` adds the most generous cache flags its --help offers (GENEROUS below). Both engines
use the machine's cores (torch's default threads; llama-server -t -1). Repeats alternate the configurations, each on
a fresh server (untimed warm-ups first), and the best run is kept; pattern figures are from the best-TTFT repeat.

Reproduce (llama.cpp is built and the weights converted as benchmark steps, never in set-up or CI):

    benchmarks/build_llama_server.sh /path/to/llama_cpp_python-0.3.36.tar.gz /work/llama   # or "-" to pip download
    python3 -m venv /work/llama/venv && /work/llama/venv/bin/pip install torch==2.13.0 transformers==5.25.0 \\
        sentencepiece numpy /work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py
    PYTHONPATH=. nice -n 10 python benchmarks/llama_server_bench.py --size tiny --out benchmarks/out/llama_tiny.json

Preparing the GGUF (`convert_gguf`): the checkpoint is cairn.bench.checkpoint.make_checkpoint's (bf16), converted
by the vendored convert_hf_to_gguf.py with `--no-mtp` (the random checkpoint has no MTP head). The converter
refuses cairn's byte-level test tokenizer twice, and the benchmark answers each in the copy it converts, never in
llama.cpp: (1) the tokenizer has no BPE merges and gguf cannot store an empty merge list, so llama.cpp would not
load it: the copy's tokenizer.json gets one merge ("Ġ Ġ", two spaces) and its token at the first free id, a token
no prompt here contains; (2) the converter recognises a pre-tokenizer only by the hash of known models' tokens,
so it is run from a wrapper that answers "default" where the hash is unknown (with one token per byte, any
pre-tokenizer split gives the same tokens). Weights, config and the ids of every other token are unchanged, and
prompts are sent as token ids, so llama.cpp's text tokenizer is never used. cairn serves the unchanged checkpoint.

What it is not: a test (it asserts nothing), a comparison of output quality (the weights are random), or a
statement about llama.cpp in general: one build, CPU only, f16/bf16 GGUFs, its default sampling chain at
temperature 0. Biases to keep in mind: the CPU may be shared (best of the repeats); timings include HTTP and JSON
on loopback for both; follow-up turns carry each engine's own reply, so the two engines' later prompts are
identical only where their replies are (the JSON records whether they were).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROMPT_TOKENS = 2000  # prefill prompt and pattern conversations
REPLY_TOKENS = 64  # decode length per request (and the replies of the patterns)
BATCH = 8  # concurrent streams of the batched decode point
IM_START, IM_END, NL = 257, 258, 10  # the byte tokenizer's ChatML tokens (cairn.bench.checkpoint.SPECIALS)
GENEROUS = ["-c", "131072", "--ctx-checkpoints", "256", "--checkpoint-min-step", "0", "--cache-ram", "-1",
            "--cache-reuse", "64"]
CONVERT_WRAPPER = """
import runpy, sys
src = sys.argv.pop(1)
sys.path.insert(0, src)
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):  # an unknown hash: a byte-per-token vocabulary, which any split tokenizes alike
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = pre
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# ---- the weights ---------------------------------------------------------------------------------------------

def make_weights(size: str, work_dir: Path) -> Path:
    """cairn's random checkpoint of `size` in bf16 under work_dir (made once, then reused)."""
    import torch

    from cairn.bench.checkpoint import make_checkpoint

    path = work_dir / size
    if not (path / "model.safetensors").exists():
        path.mkdir(parents=True, exist_ok=True)
        make_checkpoint(size, path, torch.bfloat16)
    return path


def convertible_copy(checkpoint: Path) -> Path:
    """A copy of `checkpoint` (weights and config linked, not copied) whose byte-level tokenizer has one BPE merge,
    "Ġ Ġ", its token at the first free id: gguf stores no empty merge list (see the module docstring)."""
    copy = checkpoint.with_name(checkpoint.name + "-for-gguf")
    copy.mkdir(exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != "tokenizer.json" and not (copy / f.name).exists():
            (copy / f.name).symlink_to(f.resolve())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    if not tokenizer["model"]["merges"]:
        tokenizer["model"]["vocab"]["ĠĠ"] = 1 + max(t["id"] for t in tokenizer["added_tokens"])
        tokenizer["model"]["merges"] = [["Ġ", "Ġ"]]
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    return copy


def convert_gguf(checkpoint: Path, outtype: str, llama_src: Path, python: str) -> Path:
    """The GGUF (`outtype`: f16 or bf16) of `checkpoint`, converted once by the vendored convert_hf_to_gguf.py."""
    out = checkpoint.with_name(f"{checkpoint.name}-{outtype}.gguf")
    if not out.exists():
        subprocess.run([python, "-c", CONVERT_WRAPPER, str(llama_src), str(convertible_copy(checkpoint)),
                        "--no-mtp", "--outtype", outtype, "--outfile", str(out)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


# ---- servers ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    name: str
    engine: str  # "cairn" or "llama"
    argv: tuple[str, ...]  # the command, without host and port


def configs(checkpoint: Path, ggufs: dict[str, Path], llama_server: str, disk_dir: Path) -> dict[str, Config]:
    cairn = (sys.executable, "-m", "cairn.cli", "serve", "--model", str(checkpoint), "--dtype", "bfloat16")
    llama = (llama_server, "-m", str(ggufs["f16"]))
    return {"cairn": Config("cairn", "cairn", cairn),
            "cairn+disk": Config("cairn+disk", "cairn", cairn + ("--disk-cache", str(disk_dir))),
            "llama": Config("llama", "llama", llama),
            "llama-np8": Config("llama -np 8", "llama", llama + ("-np", str(BATCH))),
            "llama-bf16-np8": Config("llama-bf16 -np 8", "llama", (llama_server, "-m", str(ggufs["bf16"]),
                                                             "-np", str(BATCH))),
            "llama-generous": Config("llama-generous", "llama", llama + tuple(GENEROUS))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    config: Config
    url: str
    log: Path
    process: subprocess.Popen


@contextmanager
def running(config: Config, log: Path):
    """One server of `config` on a free loopback port, ready (/health 200) when yielded, stopped after."""
    port = free_port()
    argv = list(config.argv) + ["--host", "127.0.0.1", "--port", str(port)]
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(config, f"http://127.0.0.1:{port}", log, process)
    try:
        wait_healthy(server)
        yield server
    finally:
        stop(process)


def wait_healthy(server: Server, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.config.name} exited at start-up: see {server.log}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{server.config.name} not healthy after {timeout_s} s: see {server.log}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ---- one request -----------------------------------------------------------------------------------------

@dataclass
class Reply:
    token_ids: list[int]
    ttft_s: float  # send to the first token
    total_s: float  # send to the last event
    cached_tokens: int  # prompt tokens the server reused
    arrivals: list[tuple[float, int]] = field(repr=False)  # (seconds since send, tokens) per streamed event


def request_body(engine: str, prompt: list[int], max_tokens: int, cache: bool) -> tuple[str, dict]:
    common = {"prompt": prompt, "temperature": 0, "ignore_eos": True, "cache_prompt": cache, "stream": True}
    if engine == "cairn":
        return "/v1/completions", {**common, "max_tokens": max_tokens, "return_token_ids": True,
                                   "stream_options": {"include_usage": True}}
    return "/completion", {**common, "n_predict": max_tokens, "return_tokens": True}


def event_tokens(engine: str, event: dict) -> tuple[list[int], int | None]:
    """The token ids an event carries, and the reused prompt tokens where it reports them."""
    if engine == "cairn":
        ids = [t for c in event.get("choices", []) for t in c.get("token_ids") or []]
        usage = event.get("usage")
        return ids, usage["prompt_tokens_details"]["cached_tokens"] if usage else None
    timings = event.get("timings")
    return event.get("tokens") or [], timings["cache_n"] if timings else None


def complete(server: Server, prompt: list[int], max_tokens: int, cache: bool = True) -> Reply:
    """One streamed greedy completion of `prompt` (token ids), EOS ignored."""
    path, body = request_body(server.config.engine, prompt, max_tokens, cache)
    ids, arrivals, cached = [], [], 0
    t0 = time.perf_counter()
    with httpx.stream("POST", server.url + path, json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            new, reused = event_tokens(server.config.engine, json.loads(line[6:]))
            if new:
                ids += new
                arrivals.append((time.perf_counter() - t0, len(new)))
            cached = reused if reused is not None else cached
    total_s = time.perf_counter() - t0
    return Reply(ids, arrivals[0][0] if arrivals else total_s, total_s, cached, arrivals)


def complete_together(server: Server, prompts: list[list[int]], max_tokens: int) -> list[Reply]:
    """The prompts sent at once, one thread each."""
    replies: list[Reply | None] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        start.wait()
        replies[i] = complete(server, prompts[i], max_tokens, cache=False)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies


def decode_tok_s(replies: list[Reply]) -> float:
    """Tokens per second over the window where every stream has its first token and none has its last."""
    t_start = max(r.arrivals[0][0] for r in replies)
    t_end = min(r.arrivals[-1][0] for r in replies)
    tokens = sum(n for r in replies for t, n in r.arrivals if t_start < t <= t_end)
    return tokens / (t_end - t_start)


# ---- prompts -----------------------------------------------------------------------------------------------

def message(rng: random.Random, role: str, num_tokens: int) -> list[int]:
    """A ChatML message of the byte tokenizer with `num_tokens` printable-ASCII content tokens."""
    return [IM_START, *role.encode(), NL, *(rng.randrange(32, 127) for _ in range(num_tokens)), IM_END, NL]


ASSISTANT = [IM_START, *b"assistant", NL]


def conversation(seed: int, num_tokens: int) -> tuple[list[int], list[int]]:
    """A system message and user / assistant turns up to about `num_tokens`, ending at an assistant header;
    and the positions where its messages start."""
    rng = random.Random(seed)
    ids, starts = message(rng, "system", 120), [0]
    while len(ids) < num_tokens - 250:
        starts.append(len(ids))
        ids += message(rng, "user" if len(starts) % 2 == 0 else "assistant", rng.randrange(120, 240))
    return ids + ASSISTANT, starts


def next_turn(prompt: list[int], reply: list[int], seed: int) -> list[int]:
    """The client's next prompt: the prompt, the reply closed, a new user message and an assistant header."""
    return prompt + reply + [IM_END, NL] + message(random.Random(seed), "user", 60) + ASSISTANT


def random_prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(num_tokens)]


# ---- prefill and decode ---------------------------------------------------------------------------------

def warm_up(server: Server, num_tokens: int) -> None:
    """Untimed: a full-length prefill and a short batched decode (first calls pay allocation and set-up)."""
    complete(server, random_prompt(-1, num_tokens), 1, cache=False)
    complete_together(server, [random_prompt(-2 - i, 32) for i in range(BATCH)], 8)


def throughput_point(server: Server, repeat: int, num_tokens: int, only: set[str]) -> dict:
    """One repeat's prefill and decode figures on a warm server."""
    row: dict = {"config": server.config.name}
    if "prefill" in only:
        reply = complete(server, random_prompt(1000 + repeat, num_tokens), 1, cache=False)
        row.update(prefill_s=reply.total_s, prefill_tok_s=num_tokens / reply.total_s, prefill_token=reply.token_ids)
    if "decode" in only:
        for batch in (1, BATCH):
            prompts = [random_prompt(2000 + 100 * repeat + i, 32) for i in range(batch)]
            row[f"decode_b{batch}_tok_s"] = decode_tok_s(complete_together(server, prompts, REPLY_TOKENS))
    return row


def run_throughput(cfgs: list[Config], args, logs: Path) -> dict[str, dict]:
    """Best of `args.repeats` per configuration, the configurations alternated, each repeat on a fresh server."""
    runs: dict[str, list[dict]] = {c.name: [] for c in cfgs}
    for repeat in range(args.repeats):
        for config in cfgs:
            with running(config, logs / f"{config.name.replace(' ', '')}.log") as server:
                warm_up(server, args.prompt_tokens)
                runs[config.name].append(throughput_point(server, repeat, args.prompt_tokens, args.only))
            print(f"  repeat {repeat} {config.name}: {fmt_point(runs[config.name][-1])}", flush=True)
    return {name: best_point(rows) for name, rows in runs.items()}


def best_point(rows: list[dict]) -> dict:
    best = {"config": rows[0]["config"], "runs": rows}
    for key in ("prefill_tok_s", "decode_b1_tok_s", f"decode_b{BATCH}_tok_s"):
        if key in rows[0]:
            best[key] = max(r[key] for r in rows)
    if "prefill_token" in rows[0]:
        best["prefill_token"] = rows[0]["prefill_token"]
    return best


def fmt_point(row: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("tok_s"))


# ---- divergence patterns ----------------------------------------------------------------------------------

def pattern_append(s, seed, n):
    c, _ = conversation(seed, n)
    first = s.complete(c)
    return next_turn(c, first.token_ids, seed + 1), len(c) + len(first.token_ids)


def pattern_strip_reasoning(s, seed, n):
    """The reply's first half stands for its reasoning, which the client drops from the history it sends."""
    c, _ = conversation(seed, n)
    first = s.complete(c)
    return next_turn(c, first.token_ids[len(first.token_ids) // 2:], seed + 1), len(c)


def pattern_compaction(s, seed, n):
    """The conversation cut at the message start nearest 60% of it, plus a compaction instruction."""
    c, starts = conversation(seed, n)
    s.complete(c)
    k = min(starts, key=lambda p: abs(p - 0.6 * len(c)))
    return c[:k] + message(random.Random(seed + 1), "user", 40) + ASSISTANT, k


def pattern_interleave(s, seed, n):
    """Conversation A, an unrelated conversation B, then A's next turn."""
    a, _ = conversation(seed, n)
    first = s.complete(a)
    s.complete(conversation(seed + 1, n)[0])
    return next_turn(a, first.token_ids, seed + 2), len(a) + len(first.token_ids)


def pattern_edit(s, seed, n):
    """The same prompt with its middle token changed (a printable byte to another)."""
    c, _ = conversation(seed, n)
    s.complete(c)
    mid = len(c) // 2
    edited = c[:mid] + [32 + (c[mid] - 32 + 1) % 95 if 32 <= c[mid] < 127 else 65] + c[mid + 1:]
    return edited, mid


def pattern_restart(s, seed, n):
    c, _ = conversation(seed, n)
    first = s.complete(c)
    s.restart()
    return next_turn(c, first.token_ids, seed + 1), len(c) + len(first.token_ids)


PATTERNS = {"append": pattern_append, "strip reasoning": pattern_strip_reasoning,
            "compaction 60%": pattern_compaction, "interleave A/B/A": pattern_interleave,
            "edit at 50%": pattern_edit, "restart": pattern_restart}


class Session:
    """A pattern's view of one configuration: completions on its running server, and a restart."""

    def __init__(self, config: Config, log: Path):
        self.config, self.log, self._cm = config, log, None
        self.server = self._start()

    def _start(self) -> Server:
        self._cm = running(self.config, self.log)
        return self._cm.__enter__()

    def complete(self, prompt: list[int], cache: bool = True) -> Reply:
        return complete(self.server, prompt, REPLY_TOKENS, cache)

    def restart(self) -> None:
        self.close()
        self.server = self._start()

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def pattern_row(session: Session, name: str, seed: int, num_tokens: int) -> dict:
    """Run a pattern; its last request warm, then cold (cache not read) on the same server."""
    prompt, ideal = PATTERNS[name](session, seed, num_tokens)
    warm = session.complete(prompt)
    cold = session.complete(prompt, cache=False)
    return {"pattern": name, "config": session.config.name, "prompt_tokens": len(prompt), "ideal_reuse": ideal,
            "cached_tokens": warm.cached_tokens, "ttft_warm_s": warm.ttft_s, "ttft_cold_s": cold.ttft_s,
            "warm_equals_cold": warm.token_ids == cold.token_ids, "warm_ids": warm.token_ids,
            "cold_ids": cold.token_ids}


def run_patterns(cfgs: list[Config], args, logs: Path, disk_dir: Path) -> list[dict]:
    """Every pattern on every configuration, alternated, one fresh server per (repeat, configuration)."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for config in cfgs:
            wipe(disk_dir)
            session = Session(config, logs / f"patterns-{config.name.replace(' ', '')}.log")
            try:
                session.complete(random_prompt(-1, 256), cache=False)  # untimed warm-up
                for i, name in enumerate(PATTERNS):
                    row = pattern_row(session, name, 10_000 * (i + 1), args.prompt_tokens)
                    runs.setdefault((name, config.name), []).append(row)
                    print(f"  repeat {repeat} {config.name} {name}: reused {row['cached_tokens']}/"
                          f"{row['ideal_reuse']}, ttft {row['ttft_warm_s']:.3f} s (cold {row['ttft_cold_s']:.3f} s),"
                          f" warm = cold {row['warm_equals_cold']}", flush=True)
            finally:
                session.close()
    return [min(rows, key=lambda r: r["ttft_warm_s"]) | {"ttft_warm_runs_s": [r["ttft_warm_s"] for r in rows]}
            for rows in runs.values()]


def wipe(directory: Path) -> None:
    if directory.exists():
        subprocess.run(["rm", "-rf", str(directory)], check=True)


# ---- report ---------------------------------------------------------------------------------------------------

def throughput_table(points: dict[str, dict], num_tokens: int) -> str:
    lines = [f"| config | cold prefill {num_tokens} tok/s | decode batch 1 tok/s | decode batch {BATCH} tok/s |",
             "|---|---:|---:|---:|"]
    for p in points.values():
        cells = [f"{p[k]:.1f}" if k in p else "-" for k in ("prefill_tok_s", "decode_b1_tok_s",
                                                            f"decode_b{BATCH}_tok_s")]
        lines.append(f"| {p['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def patterns_table(rows: list[dict]) -> str:
    """One row per (pattern, configuration); the last column says whether its cold output is cairn's cold output
    (the prompts are the same only where the engines' earlier replies were)."""
    lines = ["| pattern | config | prompt | reusable | reused | TTFT warm s | TTFT cold s | warm = cold "
             "| cold = cairn's cold |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
    cairn = {r["pattern"]: r["cold_ids"] for r in rows if r["config"] == "cairn"}
    for r in sorted(rows, key=lambda r: list(PATTERNS).index(r["pattern"])):
        same = "-" if r["pattern"] not in cairn else "yes" if r["cold_ids"] == cairn[r["pattern"]] else "no"
        lines.append(f"| {r['pattern']} | {r['config']} | {r['prompt_tokens']} | {r['ideal_reuse']} "
                     f"| {r['cached_tokens']} | {r['ttft_warm_s']:.3f} | {r['ttft_cold_s']:.3f} "
                     f"| {'yes' if r['warm_equals_cold'] else 'NO'} | {same} |")
    return "\n".join(lines)


def machine(llama_server: str, logs: Path) -> dict:
    import torch

    from benchmarks.decode_bench import cpu_info

    version = subprocess.run([llama_server, "--version"], capture_output=True, text=True)
    layout = [line.split("INFO ", 1)[-1] for log in sorted(logs.glob("*cairn*.log"))
              for line in log.read_text().splitlines() if "weight layout:" in line]
    return {"cpu": cpu_info(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "llama_server_version": (version.stdout + version.stderr).strip(),
            "cairn_weight_layout": layout[0] if layout else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "0.8b"])
    ap.add_argument("--llama-server", default="/work/llama/build/bin/llama-server")
    ap.add_argument("--llama-src", default="/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp",
                    help="the vendored llama.cpp: its convert_hf_to_gguf.py converts the weights")
    ap.add_argument("--convert-python", default="/work/llama/venv/bin/python",
                    help="a Python with torch, transformers and the vendored gguf-py, for the converter")
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "cairn_llama_bench"),
                    help="checkpoints, GGUFs, server logs (checkpoints and GGUFs are reused)")
    ap.add_argument("--only", default="prefill,decode,patterns", type=lambda s: set(s.split(",")))
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per point; the best is kept")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--out", default=None, help="write everything as JSON here")
    args = ap.parse_args()
    work = Path(args.work_dir)
    logs = work / f"logs-{args.size}-{time.strftime('%Y%m%d-%H%M%S')}"
    logs.mkdir(parents=True)
    checkpoint = make_weights(args.size, work)
    ggufs = {t: convert_gguf(checkpoint, t, Path(args.llama_src), args.convert_python) for t in ("f16", "bf16")}
    disk_dir = work / "cairn-disk-cache"
    cfgs = configs(checkpoint, ggufs, args.llama_server, disk_dir)
    result: dict = {"size": args.size, "prompt_tokens": args.prompt_tokens, "reply_tokens": REPLY_TOKENS,
                    "flags": {name: list(c.argv) for name, c in cfgs.items()}}
    if args.only & {"prefill", "decode"}:
        points = run_throughput([cfgs["cairn"], cfgs["llama-np8"], cfgs["llama-bf16-np8"]], args, logs)
        result["throughput"] = points
    if "patterns" in args.only:
        result["patterns"] = run_patterns([cfgs[n] for n in ("cairn", "cairn+disk", "llama", "llama-generous")],
                                          args, logs, disk_dir)
    result["machine"] = machine(args.llama_server, logs)
    cpu = result["machine"]["cpu"]
    print(f"\n{cpu['model']} ({', '.join(cpu['flags'])}), {result['machine']['cpus']} CPUs, torch "
          f"{result['machine']['torch']}, {result['machine']['llama_server_version'].splitlines()[0]}, "
          f"size {args.size}\ncairn: {result['machine']['cairn_weight_layout']}\n")
    if "throughput" in result:
        print(throughput_table(result["throughput"], args.prompt_tokens) + "\n")
    if "patterns" in result:
        print(patterns_table(result["patterns"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
