"""Can one client's request parameters stall the other streams? A victim stream's inter-token gaps
alone, beside a plain attacker (one more ordinary stream: the proportionate slow-down of a bigger
batch), and beside each attacker kind, on a running `cairn serve` (demo model).

    python benchmarks/attack_bench.py --url http://127.0.0.1:8501 [--window 4] [--kinds stop,bias]

For each kind, in turn: the victim (a streamed /v1/completions, ignore_eos, every token an event)
runs alone for --window seconds, then with the attacker(s) running for the same window (restarted
if one finishes). Reports max gap, p99 gap and tokens/s of the victim in each window. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

LONG = "lorem ipsum dolor sit amet " * 40


def _schema(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(50)]}
                                             for i in range(n)}}


def _tools(n: int) -> list:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 5,
             "parameters": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                            "required": ["a"]}}} for i in range(n)]


# kind -> (path, body, concurrency); bodies stream unless they say otherwise
ATTACKS = {
    "plain": ("/v1/completions", {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}, 1),
    "n16_logprobs": ("/v1/completions", {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "n": 16,
                                         "logprobs": 5}, 1),
    "n16": ("/v1/completions", {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "n": 16}, 1),
    "chat_n16": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                                          "ignore_eos": True, "n": 16}, 1),
    "plain_x16": ("/v1/completions", {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}, 16),
    "chat_n16_top20": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                                                "ignore_eos": True, "n": 16, "logprobs": True, "top_logprobs": 20}, 1),
    "stop16_long": ("/v1/completions", {"prompt": "hi", "max_tokens": 20000, "ignore_eos": True,
                                        "stop": [LONG + str(i) for i in range(16)],
                                        "include_stop_str_in_output": True}, 1),
    "stop16_huge": ("/v1/completions", {"prompt": "hi", "max_tokens": 20000, "ignore_eos": True,
                                        "stop": [("x" * 200_000) + str(i) for i in range(16)],
                                        "include_stop_str_in_output": True}, 1),
    "bias1024": ("/v1/completions", {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True,
                                     "logit_bias": {str(i % 256): 1.0 for i in range(256)}}, 1),
    "penalties": ("/v1/completions", {"prompt": "hi " * 20, "max_tokens": 20000, "ignore_eos": True,
                                      "repetition_penalty": 1.2, "presence_penalty": 0.5,
                                      "frequency_penalty": 0.5}, 1),
    "ctx16k_x4": ("/v1/completions", {"prompt": "hi " * 5400, "max_tokens": 4000, "ignore_eos": True}, 4),
    "ctx16k_x4_penalties": ("/v1/completions", {"prompt": "hi " * 5400, "max_tokens": 4000, "ignore_eos": True,
                                               "repetition_penalty": 1.2, "frequency_penalty": 0.5}, 4),
    "min_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 20000, "min_tokens": 20000}, 1),
    "tools100_auto": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                                              "ignore_eos": True, "tools": _tools(100), "tool_choice": "auto"}, 1),
    "tools100_required": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 4000, "tools": _tools(100),
                                                   "tool_choice": "required"}, 1),
    "schema_enum": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                                            "response_format": {"type": "json_schema", "json_schema": {
                                                "name": "x", "schema": _schema(200)}}}, 1),
    "long_prompt": ("/v1/completions", {"prompt": "word " * 12000, "max_tokens": 1}, 1),
    "tokenize_huge": ("/tokenize", {"prompt": "word " * 1_000_000}, 1),
    "probe_x8": ("/v1/cache/probe", {"prompt": "word " * 3000, "max_tokens": 1}, 8),
    "metrics_x4": ("/metrics", None, 4),
    "thinking": ("/v1/messages", {"model": "cairn-demo", "max_tokens": 4000, "messages": [
        {"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 3000}}, 1),
}


def victim(url: str, times: list[float], stop: threading.Event) -> None:
    body = {"prompt": "a story", "max_tokens": 60000, "stream": True, "ignore_eos": True, "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
            if stop.is_set():
                return


def attacker(url: str, path: str, body: dict | None, stop: threading.Event, log: list) -> None:
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            try:
                if body is None:
                    r = client.get(url + path)
                    log.append(r.status_code)
                    continue
                b = dict(body)
                if path != "/tokenize" and not path.startswith("/v1/cache"):
                    b["stream"] = True
                with client.stream("POST", url + path, json=b) as r:
                    log.append(r.status_code)
                    if r.status_code != 200:
                        log.append(r.read()[:300].decode(errors="replace"))
                        time.sleep(0.5)
                        continue
                    for _ in r.iter_bytes():
                        if stop.is_set():
                            return
            except httpx.HTTPError as e:
                log.append(repr(e))


def stats(times: list[float], t0: float, t1: float) -> dict:
    ts = [t for t in times if t0 <= t <= t1]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
    if not gaps:
        return {"max_ms": float("nan"), "p99_ms": float("nan"), "tok_s": 0.0}
    return {"max_ms": round(gaps[-1] * 1e3, 1), "p99_ms": round(gaps[int(0.99 * (len(gaps) - 1))] * 1e3, 1),
            "med_ms": round(statistics.median(gaps) * 1e3, 2), "tok_s": round(len(ts) / (t1 - t0), 1)}


def run_kind(url: str, kind: str, window: float) -> dict:
    path, body, conc = ATTACKS[kind]
    if kind.startswith("ctx"):  # its prompt computed once before: the prefix cache holds it, the window is decode
        httpx.post(url + path, json={**body, "max_tokens": 1, "stream": False}, timeout=600)
    times: list[float] = []
    vstop = threading.Event()
    v = threading.Thread(target=victim, args=(url, times, vstop), daemon=True)
    v.start()
    while len(times) < 20:
        if not v.is_alive():
            raise RuntimeError("the victim stream did not start")
        time.sleep(0.01)
    a0 = time.monotonic()
    time.sleep(window)
    a1 = time.monotonic()
    astop, log = threading.Event(), []
    attackers = [threading.Thread(target=attacker, args=(url, path, body, astop, log), daemon=True)
                 for _ in range(conc)]
    for t in attackers:
        t.start()
    time.sleep(2.0 if kind.startswith("ctx") else 0.5)  # let it get going
    b0 = time.monotonic()
    time.sleep(window)
    b1 = time.monotonic()
    astop.set()
    vstop.set()
    for t in attackers:
        t.join(60)
    v.join(60)
    statuses = sorted({x for x in log if isinstance(x, int)})
    errors = [x for x in log if not isinstance(x, int)][:1]
    return {"kind": kind, "alone": stats(times, a0, a1), "attacked": stats(times, b0, b1),
            "statuses": statuses, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--kinds", default=",".join(ATTACKS))
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    for _ in range(args.rounds):
        for kind in args.kinds.split(","):
            print(json.dumps(run_kind(args.url, kind, args.window)), flush=True)


if __name__ == "__main__":
    main()
