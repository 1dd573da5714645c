"""Engine throughput, cairn against Hugging Face transformers on the same random weights, in one run.

Reports cold prefill tokens/s (512 and 2048 tokens), batch-1 decode tokens/s and batch-8 aggregate decode
tokens/s, at two sizes: `tiny` and `0.8b` (the Qwen3.5-0.8B dimensions: hidden 1024, 24 layers = 18 Gated
DeltaNet + 6 gated attention, 16 value heads of 128, 8 query / 2 KV heads of 256, intermediate 3584; the
vocabulary is cut to 32k to save memory, which changes only the lm_head cost). The checkpoints are
made by cairn.bench.checkpoint.make_checkpoint, as for `cairn bench --size` and the other benchmarks.

    python benchmarks/engine_throughput.py --sizes tiny,0.8b --out benchmarks/out/engine_throughput.json

This is a benchmark, not a test: it asserts nothing and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from cairn.bench.checkpoint import make_checkpoint


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- cairn ---------------------------------------------------------------------------------------------

def cairn_engine(path: Path, dtype: str = "float32", max_num_seqs: int = 8, **model_options):
    from cairn.config import CacheOptions, EngineConfig, MemoryOptions, ModelOptions, SchedulerOptions
    from cairn.engine.engine import Engine

    # the prefix cache is off: this measures the engine itself, and a repeated prompt must be computed again
    cfg = EngineConfig(ModelOptions(model=str(path), dtype=dtype, device="cpu", **model_options),
                       MemoryOptions(page_size=16, kv_cache_gib=0.5, state_cache_gib=0.5),
                       SchedulerOptions(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
                       CacheOptions(prefix_cache=False))
    return Engine(cfg, show_progress=False)


def cairn_prefill_s(engine, n: int) -> float:
    from cairn.request.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(prompt(n, seed=n), SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def cairn_decode_tok_s(engine, batch: int, new_tokens: int, prompt_len: int = 128, cache_prompt: bool = True) -> float:
    """Aggregate decode tokens/s once every request has its first token (cache_prompt False: the prompts
    are neither resumed from nor stored in an engine's prefix cache)."""
    from cairn.request.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True, cache_prompt=cache_prompt)
    ids = {engine.add_request(prompt(prompt_len, seed=i), params) for i in range(batch)}
    started, t0, produced = set(), None, 0
    while engine.has_unfinished():
        outs = engine.step()
        if t0 is not None:
            produced += sum(len(o.delta_token_ids) for o in outs)
        started |= {o.request_id for o in outs}
        if t0 is None and started >= ids:
            t0 = time.perf_counter()
    return produced / (time.perf_counter() - t0)


# ---- transformers ---------------------------------------------------------------------------------------

def hf_prefill_s(model, n: int) -> float:
    ids = torch.tensor([prompt(n, seed=n)])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


def hf_decode_tok_s(model, batch: int, new_tokens: int, prompt_len: int = 128) -> float:
    ids = torch.tensor([prompt(prompt_len, seed=i) for i in range(batch)])
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens + 1, **kw)
        t2 = time.perf_counter()
    return batch * new_tokens / ((t2 - t1) - (t1 - t0))


def spread(runs: list[float]) -> str:
    """How far repeated runs of one figure lie apart: 'lo-hi' (printed beside the figure kept)."""
    return f"{min(runs):.3g}-{max(runs):.3g}" if len(runs) > 1 else "one run"


def run_size(size: str, new_tokens: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        hf = make_checkpoint(size, Path(d))
        engine = cairn_engine(Path(d))
        cairn_prefill_s(engine, 64), hf_prefill_s(hf, 64)  # warm-up
        row = {"size": size}
        points = {f"prefill{n}": (lambda n=n: n / cairn_prefill_s(engine, n), lambda n=n: n / hf_prefill_s(hf, n))
                  for n in (512, 2048)}
        points.update({f"decode_b{b}": (lambda b=b: cairn_decode_tok_s(engine, b, new_tokens),
                                        lambda b=b: hf_decode_tok_s(hf, b, new_tokens)) for b in (1, 8)})
        for metric, (cairn_fn, hf_fn) in points.items():  # the fastest of `repeats` runs, the two sides alternating
            cairn_runs, hf_runs = [], []
            for _ in range(repeats):
                cairn_runs.append(cairn_fn())
                hf_runs.append(hf_fn())
            row[f"{metric}_cairn_tok_s"], row[f"{metric}_hf_tok_s"] = max(cairn_runs), max(hf_runs)
            row[f"{metric}_cairn_runs"], row[f"{metric}_hf_runs"] = cairn_runs, hf_runs
        return row


def table(rows: list[dict]) -> str:
    lines = ["| size | metric | cairn tok/s (spread) | transformers tok/s (spread) | cairn / transformers |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        for metric in ("prefill512", "prefill2048", "decode_b1", "decode_b8"):
            c, h = r[f"{metric}_cairn_tok_s"], r[f"{metric}_hf_tok_s"]
            lines.append(f"| {r['size']} | {metric} | {c:.1f} ({spread(r[f'{metric}_cairn_runs'])}) | {h:.1f} "
                         f"({spread(r[f'{metric}_hf_runs'])}) | {c / h:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,0.8b")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode tokens measured per request")
    ap.add_argument("--repeats", type=int, default=2, help="runs per point (prefill and decode); the best is kept")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [run_size(s, args.new_tokens, args.repeats) for s in args.sizes.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, CPU\n")
    print(table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
