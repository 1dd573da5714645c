"""Mamba2 families at real sizes: snapshot bytes per slot, and prefill / decode tok/s against transformers.

    PYTHONPATH=. python benchmarks/family_bench.py --out benchmarks/out/family_bench.json
    PYTHONPATH=. python benchmarks/family_bench.py --speed none          # the snapshot table alone, no weights

1. Snapshot bytes per slot (a snapshot is every recurrent layer's state at one position), computed from the
   state spec cairn builds for each config (no weights): every named size of cairn.bench.checkpoint, plus
   the larger published sizes in PUBLISHED (their dimensions only). Printed beside it: the KV bytes of one
   token, and how many tokens of KV one snapshot weighs.
2. Speed (`--speed`, default the three real small sizes, one per Mamba2 family): random weights made by
   transformers in bf16 (cairn.bench.checkpoint.make_checkpoint), loaded by cairn from the saved checkpoint,
   both in bf16 on the CPU with the prefix cache off. A 512-token prefill and a batch-1 decode of 16
   tokens (after a 128-token prompt); each repeat runs cairn then transformers, the best of `--repeats`
   is kept. One size at a time: its checkpoint is made, measured and deleted before the next. Where two
   copies of a model do not fit in the available memory, transformers' runs all come first, then cairn's.

This is a benchmark, not a test: it asserts nothing and prints markdown tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_throughput import (
    cairn_decode_tok_s,
    cairn_engine,
    cairn_prefill_s,
    hf_decode_tok_s,
    hf_prefill_s,
)
from cairn.bench.checkpoint import SIZES, hf_config, make_checkpoint
from cairn.engine.sizing import available_ram_bytes
from cairn.model.families import config_from_hf

REAL_SMALL = "granite-4.0-h-350m,falcon-h1-0.5b,nemotron-h-4b"  # smallest first
PROMPT_TOKENS, DECODE_TOKENS = 512, 16

# Falcon-H1: (layers, hidden, attention heads, KV heads, head_dim, mamba heads, mamba head_dim, d_state) from
# transformers' Falcon-H1 documentation, other keys as the 0.5B's; Granite-4.0-H-Tiny from its config.json.
FALCON_H1 = {"1.5b": (24, 2048, 8, 2, 128, 48, 64, 256), "1.5b-deep": (66, 1280, 6, 2, 128, 24, 64, 256),
             "3b": (32, 2560, 10, 2, 128, 32, 128, 256), "7b": (44, 3072, 12, 2, 128, 24, 128, 256),
             "34b": (72, 5120, 20, 4, 128, 32, 128, 256)}
GRANITE_TINY = dict(
    hidden_size=1536, num_hidden_layers=40, num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48,
    mamba_d_head=64, num_local_experts=64, num_experts_per_tok=6, intermediate_size=512, shared_intermediate_size=1024,
    attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=6.0,
    layer_types=["mamba"] * 5 + (["attention"] + ["mamba"] * 9) * 3 + ["attention"] + ["mamba"] * 4)


def raw_config(size: str) -> dict:
    """config.json of a named size as save_pretrained writes it (what cairn's loader reads)."""
    with tempfile.TemporaryDirectory() as d:
        hf_config(size).save_pretrained(d)
        return json.loads((Path(d) / "config.json").read_text())


def published() -> dict[str, dict]:
    """name -> config.json of the larger published sizes (dimensions only: no weights are made)."""
    falcon, granite = raw_config("falcon-h1-0.5b"), raw_config("granite-4.0-h-350m")
    out = {}
    for name, (layers, hidden, heads, kv, head_dim, m_heads, m_head_dim, state) in FALCON_H1.items():
        out[f"falcon-h1-{name}"] = {**falcon, "num_hidden_layers": layers, "hidden_size": hidden,
                                    "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
                                    "mamba_n_heads": m_heads, "mamba_d_head": m_head_dim,
                                    "mamba_d_ssm": m_heads * m_head_dim, "mamba_d_state": state}
    out["granite-4.0-h-tiny"] = {**granite, **GRANITE_TINY}
    return out


def snapshot_row(size: str, raw: dict, dtype: torch.dtype) -> dict:
    cfg = config_from_hf(raw)
    spec = cfg.state_spec(dtype)
    per_layer = {t.name: t.nbytes for t in spec.layers[0].tensors}
    kv_token = 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return {"size": size, "family": cfg.family, "recurrent_layers": len(cfg.recurrent_layers),
            "attention_layers": len(cfg.attention_layers), "per_layer_bytes": per_layer,
            "snapshot_bytes": spec.slot_bytes, "kv_bytes_per_token": kv_token}


def snapshot_table(rows: list[dict]) -> str:
    lines = ["| size | family | recurrent / attention layers | state per recurrent layer | snapshot per slot "
             "| KV per token | snapshot = KV of |", "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        layer = ", ".join(f"{k} {v / 2**10:,.1f} KiB" for k, v in r["per_layer_bytes"].items())
        lines.append(f"| {r['size']} | {r['family']} | {r['recurrent_layers']} / {r['attention_layers']} | {layer} "
                     f"| {r['snapshot_bytes']:,} ({r['snapshot_bytes'] / 2**20:,.2f} MiB) "
                     f"| {r['kv_bytes_per_token'] / 2**10:,.1f} KiB "
                     f"| {r['snapshot_bytes'] / r['kv_bytes_per_token']:,.0f} tokens |")
    return "\n".join(lines)


# ---- speed ------------------------------------------------------------------------------------------------

def _measures(engine, hf) -> dict:
    return {f"prefill{PROMPT_TOKENS}": (lambda: PROMPT_TOKENS / cairn_prefill_s(engine, PROMPT_TOKENS),
                                        lambda: PROMPT_TOKENS / hf_prefill_s(hf, PROMPT_TOKENS)),
            f"decode_b1_{DECODE_TOKENS}": (lambda: cairn_decode_tok_s(engine, 1, DECODE_TOKENS),
                                           lambda: hf_decode_tok_s(hf, 1, DECODE_TOKENS))}


def speed(size: str, repeats: int) -> dict:
    """{metric: {"cairn": runs, "hf": runs}} for one size, plus how the runs were ordered and the seconds."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        hf = make_checkpoint(size, Path(d), dtype=torch.bfloat16)
        model_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        together = 1.2 * model_bytes < available_ram_bytes()  # transformers' copy is already in memory
        runs: dict[str, dict[str, list[float]]] = {}
        if together:  # alternating: load from other processes hits both sides alike
            engine = cairn_engine(Path(d), dtype="bfloat16", max_num_seqs=2)
            cairn_prefill_s(engine, 64), hf_prefill_s(hf, 64)  # warm-up
            for metric, (cairn_fn, hf_fn) in _measures(engine, hf).items():
                pairs = [(cairn_fn(), hf_fn()) for _ in range(repeats)]
                runs[metric] = {"cairn": [c for c, _ in pairs], "hf": [h for _, h in pairs]}
        else:  # transformers' runs, then (its copy freed) cairn's
            hf_prefill_s(hf, 64)
            for metric, (_, hf_fn) in _measures(None, hf).items():
                runs[metric] = {"hf": [hf_fn() for _ in range(repeats)]}
            del hf
            gc.collect()
            engine = cairn_engine(Path(d), dtype="bfloat16", max_num_seqs=2)
            cairn_prefill_s(engine, 64)
            for metric, (cairn_fn, _) in _measures(engine, None).items():
                runs[metric]["cairn"] = [cairn_fn() for _ in range(repeats)]
    return {"size": size, "alternating": together, "model_bytes": model_bytes, "runs": runs,
            "seconds": time.perf_counter() - t0}


def speed_table(rows: list[dict]) -> str:
    lines = ["| size | metric | cairn tok/s (runs) | transformers tok/s (runs) | cairn / transformers |",
             "|---|---|---:|---:|---:|"]
    for row in rows:
        for metric, r in row["runs"].items():
            c, h = max(r["cairn"]), max(r["hf"])
            fmt = ", ".join
            lines.append(f"| {row['size']} | {metric} | {c:.2f} ({fmt(f'{x:.3g}' for x in r['cairn'])}) "
                         f"| {h:.2f} ({fmt(f'{x:.3g}' for x in r['hf'])}) | {c / h:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", default=REAL_SMALL, help="sizes to measure against transformers, or 'none'")
    ap.add_argument("--repeats", type=int, default=2, help="runs per point and side; the best is kept")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="write every figure as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = {**{s: raw_config(s) for s in SIZES}, **published()}
    snapshots = [snapshot_row(s, raw, torch.bfloat16) for s, raw in configs.items()]
    print("Snapshot bytes per slot, bf16 model (conv states bf16, recurrent / SSM states fp32):\n")
    print(snapshot_table(snapshots), "\n", flush=True)
    rows = []
    for size in [] if args.speed == "none" else args.speed.split(","):
        rows.append(speed(size, args.repeats))
        print(f"{size}: {rows[-1]['seconds']:.0f} s", rows[-1]["runs"], flush=True)
    if rows:
        print(f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
              "bfloat16, random weights\n")
        print(speed_table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"snapshots": snapshots, "speed": rows}, indent=2))


if __name__ == "__main__":
    main()
