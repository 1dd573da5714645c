"""Granite-4.0-H (`granitemoehybrid`): snapshot bytes per slot, and cairn against transformers on the same
random weights at Granite-4.0-H-350M's dimensions, side by side in one run.

    PYTHONPATH=. python benchmarks/granite_bench.py --out benchmarks/out/granite_bench.json

Snapshot bytes are computed from the state spec cairn builds for the published configs' dimensions (no
weights needed): Tiny (40 layers, 36 Mamba2 of 48 heads x 64 x state 128, 64 experts) and 350M (32 layers,
28 Mamba2 of 48 heads x 32 x state 128, dense). Throughput uses a random checkpoint with the 350M
dimensions (hidden 768, 28 Mamba2 + 4 NoPE attention layers, 12 query / 4 KV heads, shared MLP 2048,
vocabulary 100352, fp32), made with transformers' own save_pretrained; prefill and decode are measured by
benchmarks/engine_throughput.py's functions, the two sides alternating, the best of `--repeats` kept.

This is a benchmark, not a test: it asserts nothing and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
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
from cairn.model.families import config_from_hf

COMMON = dict(
    model_type="granitemoehybrid", hidden_act="silu", vocab_size=100352, max_position_embeddings=131072,
    mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True,
    mamba_proj_bias=False, position_embedding_type="nope", rms_norm_eps=1e-5, tie_word_embeddings=True,
    embedding_multiplier=12.0,
)
# the published configs' dimensions (ibm-granite/granite-4.0-h-tiny, ibm-granite/granite-4.0-h-350m)
SIZES = {
    "tiny": dict(COMMON, hidden_size=1536, num_hidden_layers=40, num_attention_heads=12, num_key_value_heads=4,
                 mamba_n_heads=48, mamba_d_head=64, num_local_experts=64, num_experts_per_tok=6,
                 intermediate_size=512, shared_intermediate_size=1024, attention_multiplier=0.0078125,
                 residual_multiplier=0.22, logits_scaling=6.0,
                 layer_types=["mamba"] * 5 + (["attention"] + ["mamba"] * 9) * 3 + ["attention"] + ["mamba"] * 4),
    "350m": dict(COMMON, hidden_size=768, num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4,
                 mamba_n_heads=48, mamba_d_head=32, num_local_experts=0, num_experts_per_tok=0,
                 intermediate_size=2048, shared_intermediate_size=2048, attention_multiplier=0.015625,
                 residual_multiplier=0.246, logits_scaling=3.0,
                 layer_types=["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)]),
}


def snapshot_rows() -> list[dict]:
    rows = []
    for size, raw in SIZES.items():
        cfg = config_from_hf(raw)
        for dtype in (torch.bfloat16, torch.float32):
            spec = cfg.state_spec(dtype)
            conv, ssm = (sum(t.nbytes for _, _, t in spec.tensors() if t.name == n) for n in ("conv", "ssm"))
            rows.append(dict(size=size, dtype=str(dtype).removeprefix("torch."), layers=len(cfg.mamba_layers),
                             conv_bytes=conv, ssm_bytes=ssm, slot_bytes=spec.slot_bytes))
    return rows


def make_checkpoint(size: str, path: Path):
    import transformers as tf

    torch.manual_seed(0)
    raw = {k: v for k, v in SIZES[size].items() if k not in ("model_type", "hidden_act")}
    model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**raw, initializer_range=0.02)).eval()
    model.save_pretrained(str(path))
    write_tokenizer(path)
    return model


def throughput(size: str, new_tokens: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        hf = make_checkpoint(size, Path(d))
        engine = cairn_engine(Path(d))
        cairn_prefill_s(engine, 64), hf_prefill_s(hf, 64)  # warm-up
        points = {f"prefill{n}": (lambda n=n: n / cairn_prefill_s(engine, n), lambda n=n: n / hf_prefill_s(hf, n))
                  for n in (512, 2048)}
        points.update({f"decode_b{b}": (lambda b=b: cairn_decode_tok_s(engine, b, new_tokens),
                                        lambda b=b: hf_decode_tok_s(hf, b, new_tokens)) for b in (1, 8)})
        row = {"size": size}
        for metric, (cairn_fn, hf_fn) in points.items():
            runs = [(cairn_fn(), hf_fn()) for _ in range(repeats)]  # the two sides alternating
            row[metric] = dict(cairn=[c for c, _ in runs], hf=[h for _, h in runs])
        return row


def tables(snapshots: list[dict], row: dict | None) -> str:
    lines = ["| dimensions | dtype | Mamba2 layers | conv bytes | SSM bytes (fp32) | snapshot bytes per slot |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['size']} | {r['dtype']} | {r['layers']} | {r['conv_bytes']:,} | {r['ssm_bytes']:,} | "
              f"{r['slot_bytes']:,} ({r['slot_bytes'] / 2**20:.2f} MiB) |" for r in snapshots]
    if row:
        lines += ["", "| size | metric | cairn tok/s (spread) | transformers tok/s (spread) | cairn / transformers |",
                  "|---|---|---:|---:|---:|"]
        for metric in ("prefill512", "prefill2048", "decode_b1", "decode_b8"):
            c, h = row[metric]["cairn"], row[metric]["hf"]
            lines.append(f"| {row['size']} | {metric} | {max(c):.1f} ({spread(c)}) | {max(h):.1f} ({spread(h)}) | "
                         f"{max(c) / max(h):.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="350m", help="dimensions for the throughput run ('none' to skip it)")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode tokens measured per request")
    ap.add_argument("--repeats", type=int, default=2, help="runs per point; the best is kept")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    snapshots = snapshot_rows()
    row = None if args.size == "none" else throughput(args.size, args.new_tokens, args.repeats)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, CPU\n")
    print(tables(snapshots, row))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"snapshots": snapshots, "throughput": row}, indent=2))


if __name__ == "__main__":
    main()
