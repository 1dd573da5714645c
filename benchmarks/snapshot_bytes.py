"""Bytes of one snapshot (every recurrent layer's state at one position) and of one token's KV, per named
size of cairn.bench.checkpoint, computed from the config alone (no weights are made).

    python benchmarks/snapshot_bytes.py --sizes 0.8b,nemotron-h-4b --dtype bfloat16

A snapshot's bytes decide how many fit in each tier's budget and how long a restore from host or disk
takes; the KV bytes per token say how many tokens of context one snapshot weighs. This is a benchmark, not a
test: it asserts nothing and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from cairn.bench.checkpoint import hf_config
from cairn.model.families import config_from_hf

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def row(size: str, dtype: torch.dtype) -> dict:
    with tempfile.TemporaryDirectory() as d:
        hf_config(size).save_pretrained(d)
        cfg = config_from_hf(json.loads((Path(d) / "config.json").read_text()))
    spec = cfg.state_spec(dtype)
    per_layer = {t.name: t.nbytes for t in spec.layers[0].tensors}
    kv_token = 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return {"size": size, "family": cfg.family, "recurrent_layers": len(cfg.recurrent_layers),
            "attention_layers": len(cfg.attention_layers), "per_layer_bytes": per_layer,
            "snapshot_bytes": spec.slot_bytes, "kv_bytes_per_token": kv_token,
            "tokens_of_kv_per_snapshot": spec.slot_bytes / kv_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.8b,nemotron-h-4b")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    args = ap.parse_args()
    print("| size | family | recurrent / attention layers | state per recurrent layer | snapshot | KV per token "
          "| snapshot = KV of |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        r = row(size, DTYPES[args.dtype])
        layer = ", ".join(f"{k} {v / 2**10:,.1f} KiB" for k, v in r["per_layer_bytes"].items())
        print(f"| {size} | {r['family']} | {r['recurrent_layers']} / {r['attention_layers']} | {layer} "
              f"| {r['snapshot_bytes'] / 2**20:,.2f} MiB | {r['kv_bytes_per_token'] / 2**10:,.1f} KiB "
              f"| {r['tokens_of_kv_per_snapshot']:,.0f} tokens |")


if __name__ == "__main__":
    main()
