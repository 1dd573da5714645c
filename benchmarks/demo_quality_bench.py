"""How well the shipped demo model does, on text it never saw: `PYTHONPATH=. python benchmarks/demo_quality_bench.py`.

Everything held out comes from cairn.demo's corpus with part="held_out" (the 5% of each source list the
training never read) and a seed the training never used:
- perplexity of the held-out documents (transformers' Qwen3.5 classes on the checkpoint, float32), overall and per
  kind (generated dialogue, Python source, English text);
- tool use: prompts cut from held-out dialogues just before an assistant turn that calls a tool (the tool-choice
  and file-agent kinds); greedy generation with cairn (`cairn-demo`, float32); the share whose reply is a
  well-formed call (cairn's own Qwen3.5 XML parser) of the right function with arguments that parse, and the share
  whose arguments are exactly the expected ones;
- reasoning: held-out prompts rendered with `enable_thinking: true`; the share of replies that close `</think>`
  and end with the end-of-sequence token within MAX_TOKENS;
- bfloat16 against float32: greedy answers to 100 held-out prompts in both dtypes; the share identical and the
  largest difference of a chosen token's logprob over the tokens both answers share.
The machine (CPU model and flags, cairn's CPU path) is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch
import torch.nn.functional as F

from cairn.config import DEMO_NAME
from cairn.demo import corpus, dialogues
from cairn.demo.train import cpu_name
from cairn.engine.llm import LLM
from cairn.model.demo_checkpoint import demo_checkpoint
from cairn.ops import cpu_isa
from cairn.request.sampling_params import SamplingParams
from cairn.server.chat.parsers import parse_call

SEED = 1000  # the training used seed 0
MAX_TOKENS = 300


def perplexity(n_docs: int) -> dict:
    import transformers as tf
    from tokenizers import Tokenizer

    path = demo_checkpoint()
    model = tf.Qwen3_5ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    rng = random.Random(SEED)
    m = corpus.material("held_out")
    w = corpus.world(SEED, "held_out")
    docs = {"dialogue": [dialogues.render(dialogues.dialogue(w)) for _ in range(n_docs)],
            "python": [corpus.window(rng, rng.choice(m["python"])) for _ in range(n_docs)],
            "english": [corpus.window(rng, rng.choice(m["english"])) for _ in range(n_docs)]}
    out = {}
    total_nll, total_n = 0.0, 0
    with torch.no_grad():
        for kind, texts in docs.items():
            nll, n = 0.0, 0
            for text in texts:
                ids = torch.tensor([tok.encode(text + corpus.END, add_special_tokens=False).ids[:2048]])
                logits = model(input_ids=ids).logits[0, :-1]
                nll += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
                n += ids.shape[1] - 1
            out[kind] = round(math.exp(nll / n), 2)
            total_nll, total_n = total_nll + nll, total_n + n
    out["all"] = round(math.exp(total_nll / total_n), 2)
    out["tokens"] = total_n
    return out


def tool_prompts(n: int) -> list[tuple[str, dict, str, dict]]:
    """(prompt text, tools by name, expected function, its arguments) cut before held-out assistant calls."""
    w = corpus.world(SEED + 1, "held_out")
    out = []
    while len(out) < n:
        d = (dialogues.agent_episode if w.rng.random() < 0.5 else dialogues.tool_choice)(w)
        cuts = [i for i, msg in enumerate(d.messages) if msg.get("tool_calls")]
        i = w.pick(cuts)
        call = d.messages[i]["tool_calls"][0]["function"]
        text = dialogues.render_prompt(d.messages[:i], d.tools)
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in d.tools}
        out.append((text, tools, call["name"], call["arguments"]))
    return out


def thinking_prompts(n: int) -> list[str]:
    w = corpus.world(SEED + 2, "held_out")
    out = []
    while len(out) < n:
        d = w.rng.choice((dialogues.docs_chat, dialogues.tool_choice, dialogues.small_talk))(w)
        cut = max(i for i, msg in enumerate(d.messages) if msg["role"] == "user") + 1
        out.append(dialogues.render_prompt(d.messages[:cut], d.tools, enable_thinking=True))
    return out


def generate(llm: LLM, texts: list[str], max_tokens: int = MAX_TOKENS, logprobs: bool = False):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    return llm.generate([llm.tokenizer.encode(t) for t in texts], params)


def tool_use(llm: LLM, n: int) -> dict:
    prompts = tool_prompts(n)
    outs = generate(llm, [p[0] for p in prompts])
    formed = exact = 0
    for (_, tools, name, arguments), out in zip(prompts, outs, strict=True):
        text = llm.tokenizer.decode(out.token_ids)
        if "<tool_call>" not in text or "</tool_call>" not in text:
            continue
        block = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
        parsed = parse_call(block, tools, complete=True)
        if parsed is None or parsed.name != name:
            continue
        args = json.loads(parsed.arguments)
        formed += set(args) == set(tools[name]["required"])
        exact += args == arguments
    return {"prompts": n, "right_call_share": round(formed / n, 3), "exact_arguments_share": round(exact / n, 3)}


def thinking(llm: LLM, n: int) -> dict:
    outs = generate(llm, thinking_prompts(n))
    closed = sum("</think>" in llm.tokenizer.decode(o.token_ids) and o.finish_reason == "stop" for o in outs)
    return {"prompts": n, "closed_and_ended_share": round(closed / n, 3)}


def dtypes(n: int) -> dict:
    texts = thinking_prompts(n // 2) + [p[0] for p in tool_prompts(n - n // 2)]
    answers = {}
    for dtype in ("float32", "bfloat16"):
        with LLM(model=DEMO_NAME, dtype=dtype) as llm:
            answers[dtype] = generate(llm, texts, max_tokens=64, logprobs=True)
    same, worst = 0, 0.0
    for a, b in zip(answers["float32"], answers["bfloat16"], strict=True):
        same += a.token_ids == b.token_ids
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=False):
            if ta != tb:
                break
            worst = max(worst, abs(la - lb))
    return {"prompts": n, "identical_share": round(same / n, 3), "max_logprob_diff": round(worst, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=100, help="held-out documents of each kind for perplexity")
    p.add_argument("--prompts", type=int, default=200, help="held-out tool-use prompts")
    p.add_argument("--thinking", type=int, default=100)
    p.add_argument("--dtype-prompts", type=int, default=100)
    args = p.parse_args()
    flags = cpu_isa.cpu_flags()
    has = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    path = cpu_isa.described(cpu_isa.choose("auto", flags), "auto", flags)
    print(f"machine: {cpu_name()} ({', '.join(has)}); {path}; {torch.get_num_threads()} threads", flush=True)
    started = time.perf_counter()
    print("perplexity", json.dumps(perplexity(args.docs)), flush=True)
    with LLM(model=DEMO_NAME) as llm:
        print("tool use", json.dumps(tool_use(llm, args.prompts)), flush=True)
        print("thinking", json.dumps(thinking(llm, args.thinking)), flush=True)
    print("bf16 vs f32", json.dumps(dtypes(args.dtype_prompts)), flush=True)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
