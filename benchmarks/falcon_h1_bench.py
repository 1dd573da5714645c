"""Falcon-H1 in cairn: snapshot bytes per slot at the released sizes, and speed against transformers.

1. Snapshot bytes, computed from cairn's own state spec (`parse_config(...).state_spec(dtype)`) for the
   dimensions of the released checkpoints (the table of transformers' Falcon-H1 documentation; the 0.5B
   from its config.json). Every Falcon-H1 layer holds a Mamba2 state, so a snapshot is num_layers x (conv
   state [conv channels, d_conv - 1] in the model dtype + SSM state [heads, head_dim, d_state] in fp32);
   the KV bytes per token are printed beside it (every layer also has attention).
2. Cold prefill and decode tokens/s, cairn against transformers on the same random weights at the
   Falcon-H1-0.5B dimensions (fp32, CPU), measured side by side: each repeat runs cairn then transformers,
   and the best of the repeats is kept (engine_throughput.py's measurements).

    PYTHONPATH=. python benchmarks/falcon_h1_bench.py --speed --out benchmarks/out/falcon_h1.json

This is a benchmark, not a test: it asserts nothing and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch

from benchmarks.engine_throughput import (
    cairn_decode_tok_s,
    cairn_engine,
    cairn_prefill_s,
    hf_decode_tok_s,
    hf_prefill_s,
    spread,
)
from cairn.bench.checkpoint import write_tokenizer
from cairn.model.falcon_h1 import parse_config

# Falcon-H1-0.5B's config.json (its multipliers included); the other sizes change the fields listed below.
BASE = dict(
    model_type="falcon_h1", vocab_size=32784, hidden_size=1024, intermediate_size=2048, num_hidden_layers=36,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=16384,
    rope_theta=1e11, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
    mamba_d_conv=4, mamba_chunk_size=128, mamba_rms_norm=False, mamba_norm_before_gate=False,
    tie_word_embeddings=False, attention_in_multiplier=1.0, attention_out_multiplier=0.9375,
    embedding_multiplier=5.656854249492381, key_multiplier=0.390625, lm_head_multiplier=0.0390625,
    mlp_multipliers=[0.8838834764831844, 0.5859375], ssm_in_multiplier=1.25, ssm_out_multiplier=0.23570226039551587,
    ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
)
# (layers, hidden, attention heads, kv heads, attention head_dim, mamba heads, mamba head_dim, d_state);
# n_groups is taken as 1 for all (it only adds 2 * n_groups * d_state conv channels: under 2% of the bytes)
SIZES = {
    "0.5B": (36, 1024, 8, 2, 64, 24, 64, 128),
    "1.5B": (24, 2048, 8, 2, 128, 48, 64, 256),
    "1.5B-Deep": (66, 1280, 6, 2, 128, 24, 64, 256),
    "3B": (32, 2560, 10, 2, 128, 32, 128, 256),
    "7B": (44, 3072, 12, 2, 128, 24, 128, 256),
    "34B": (72, 5120, 20, 4, 128, 32, 128, 256),
}


def size_config(name: str) -> dict:
    layers, hidden, heads, kv, head_dim, m_heads, m_head_dim, state = SIZES[name]
    return {**BASE, "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "mamba_n_heads": m_heads, "mamba_d_head": m_head_dim,
            "mamba_d_ssm": m_heads * m_head_dim, "mamba_d_state": state}


def snapshot_table(dtype: torch.dtype = torch.bfloat16) -> str:
    name = str(dtype).removeprefix("torch.")
    lines = [f"| size | layers | snapshot bytes per slot ({name}) | of which SSM (fp32) | KV bytes per token "
             "| tokens of KV one snapshot weighs |", "|---|---:|---:|---:|---:|---:|"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name in SIZES:
        cfg = parse_config(size_config(name))
        spec = cfg.state_spec(dtype)
        total = spec.slot_bytes
        ssm = sum(t.nbytes for layer in spec.layers for t in layer.tensors if t.name == "ssm")
        kv_token = 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * itemsize
        lines.append(f"| Falcon-H1-{name} | {cfg.num_layers} | {total:,} ({total / 2**20:.1f} MiB) | {ssm / total:.1%} "
                     f"| {kv_token:,} | {total / kv_token:,.0f} |")
    return "\n".join(lines)


def speed(repeats: int, new_tokens: int) -> list[dict]:
    import transformers as tf

    torch.manual_seed(0)
    raw = {k: v for k, v in BASE.items() if k != "model_type"}
    hf = tf.FalconH1ForCausalLM(tf.FalconH1Config(**raw)).eval()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        write_tokenizer(Path(d))
        engine = cairn_engine(Path(d))
        cairn_prefill_s(engine, 64), hf_prefill_s(hf, 64)  # warm-up
        points = {"prefill512": (lambda: 512 / cairn_prefill_s(engine, 512), lambda: 512 / hf_prefill_s(hf, 512)),
                  "decode_b1": (lambda: cairn_decode_tok_s(engine, 1, new_tokens),
                                lambda: hf_decode_tok_s(hf, 1, new_tokens)),
                  "decode_b8": (lambda: cairn_decode_tok_s(engine, 8, new_tokens),
                                lambda: hf_decode_tok_s(hf, 8, new_tokens))}
        for metric, (cairn_fn, hf_fn) in points.items():
            cairn_runs, hf_runs = [], []
            for _ in range(repeats):  # alternating, so load from other processes hits both sides alike
                cairn_runs.append(cairn_fn())
                hf_runs.append(hf_fn())
            rows.append({"metric": metric, "cairn_runs": cairn_runs, "hf_runs": hf_runs})
            print(metric, cairn_runs, hf_runs, flush=True)
    return rows


def speed_table(rows: list[dict]) -> str:
    lines = ["| metric | cairn tok/s (spread) | transformers tok/s (spread) | cairn / transformers |",
             "|---|---:|---:|---:|"]
    for r in rows:
        c, h = max(r["cairn_runs"]), max(r["hf_runs"])
        lines.append(f"| {r['metric']} | {c:.1f} ({spread(r['cairn_runs'])}) | {h:.1f} ({spread(r['hf_runs'])}) "
                     f"| {c / h:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", action="store_true", help="also measure tok/s against transformers at 0.5B dims")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write the speed rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(snapshot_table(torch.bfloat16), "\n")
    if args.speed:
        rows = speed(args.repeats, args.new_tokens)
        print(f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
              "fp32, Falcon-H1-0.5B dimensions, random weights\n")
        print(speed_table(rows))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
