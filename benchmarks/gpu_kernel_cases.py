"""The kernel cases of benchmarks/gpu_check.py: inputs at a named shape, and one call of a Kernels field.

Each case is (Kernels field, make_inputs(shape, device) -> dict of float32 tensors, run(kernels, inputs,
dtype) -> list of output tensors). `run` casts the inputs to `dtype` (the recurrent states stay float32,
as in cairn's state pool), clones whatever a kernel updates in place, and returns every output the
contract defines: outputs, final states and the states captured inside a segment.

Shapes: those of the `tiny` and `0.8b` random checkpoints (cairn/bench/checkpoint.py): tiny has 2 key
and 4 value heads of 64, attention 4 query / 2 KV heads of 64 (head dims FlashInfer and fla compile
for; the unit tests' checkpoints use 16); 0.8b is Qwen3.5-0.8B's (16 key and value heads of 128, conv
kernel 4; attention 8 query / 2 KV heads of 256). The Mamba2 conv widths are Nemotron-H-like.
"""

from __future__ import annotations

import torch

from cairn.ops import Kernels

SHAPES = {
    "tiny": dict(k_heads=2, v_heads=4, k_dim=64, v_dim=64, conv_kernel=4, heads=4, kv_heads=2, head_dim=64,
                 mamba_channels=160, tokens=100, batch=4, page_size=16, pages=64),
    "0.8b": dict(k_heads=16, v_heads=16, k_dim=128, v_dim=128, conv_kernel=4, heads=8, kv_heads=2, head_dim=256,
                 mamba_channels=3328, tokens=1500, batch=16, page_size=16, pages=2048),
}


def _gen(device: str, seed: int = 0) -> tuple[torch.Generator, str]:
    return torch.Generator(device=device).manual_seed(seed), device


def _randn(g, *shape, scale: float = 1.0) -> torch.Tensor:
    gen, device = g
    return torch.randn(*shape, generator=gen, device=device) * scale


def _rand(g, *shape) -> torch.Tensor:
    gen, device = g
    return torch.rand(*shape, generator=gen, device=device)


def _cast(inputs: dict, dtype: torch.dtype, keep_fp32=("state", "g")) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() and k not in keep_fp32 else v.clone() for k, v in inputs.items()}


# ---- Gated DeltaNet -------------------------------------------------------------------------------------

def gdn_inputs(s: dict, device: str, batch: int | None = None) -> dict:
    g = _gen(device)
    n = batch or s["tokens"]
    return {"q": _randn(g, n, s["k_heads"], s["k_dim"]), "k": _randn(g, n, s["k_heads"], s["k_dim"]),
            "v": _randn(g, n, s["v_heads"], s["v_dim"]), "g": -_rand(g, n, s["v_heads"]) * 0.5,
            "beta": _rand(g, n, s["v_heads"]),
            "state": _randn(g, *((batch,) if batch else ()), s["v_heads"], s["k_dim"], s["v_dim"], scale=0.1)}


def gdn_chunk(kernels: Kernels, inputs: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    x = _cast(inputs, dtype)
    tokens = x["q"].shape[0]
    caps = [(c, torch.empty_like(x["state"])) for c in (1, tokens // 3, tokens)]
    out, final = kernels.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], caps)
    return [out, final, *(t for _, t in caps)]


def gdn_recurrent(kernels: Kernels, inputs: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    x = _cast(inputs, dtype)
    pool = torch.cat([x["state"][:1], x["state"]])  # the batch's states a view inside a larger pool
    view = pool[1:]
    out, _ = kernels.recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], view)
    return [out, pool[1:]]  # the contract: updated where it lies


# ---- causal conv ----------------------------------------------------------------------------------------

def conv_inputs(s: dict, device: str, batch: int | None = None, channels: int | None = None) -> dict:
    g = _gen(device, 1)
    c = channels or 2 * s["k_heads"] * s["k_dim"] + s["v_heads"] * s["v_dim"]
    lead = (batch,) if batch else ()
    return {"x": _randn(g, batch or s["tokens"], c), "conv_state": _randn(g, *lead, c, s["conv_kernel"] - 1),
            "weight": _randn(g, c, s["conv_kernel"], scale=0.5), "bias": _randn(g, c, scale=0.1)}


def conv_prefill(kernels: Kernels, inputs: dict, dtype: torch.dtype, mamba: bool = False) -> list[torch.Tensor]:
    x = _cast(inputs, dtype)
    tokens = x["x"].shape[0]
    caps = [(c, torch.empty_like(x["conv_state"])) for c in (1, 2, tokens // 2, tokens)]
    if mamba:
        out, final = kernels.mamba_conv1d(x["x"], x["conv_state"], x["weight"], x["bias"], caps)
    else:
        out, final = kernels.causal_conv1d(x["x"], x["conv_state"], x["weight"], caps)
    return [out, final, *(t for _, t in caps)]


def conv_update(kernels: Kernels, inputs: dict, dtype: torch.dtype, mamba: bool = False) -> list[torch.Tensor]:
    x = _cast(inputs, dtype)
    if mamba:
        return list(kernels.mamba_conv1d_update(x["x"], x["conv_state"], x["weight"], x["bias"]))
    return list(kernels.causal_conv1d_update(x["x"], x["conv_state"], x["weight"]))


# ---- paged attention ------------------------------------------------------------------------------------

def attention_inputs(s: dict, device: str, queries: int) -> dict:
    """Pools of s["pages"] pages; `queries` sequences' pages scattered over them (a random permutation)."""
    g = _gen(device, 2)
    ps, pages = s["page_size"], s["pages"]
    per_seq = pages // max(queries, 1)
    lens = (per_seq * ps - (_rand(g, queries) * (ps * 4)).long()).clamp(min=1)
    perm = torch.randperm(pages, generator=g[0], device=device)[: per_seq * queries]
    return {"q": _randn(g, queries, s["heads"], s["head_dim"]),
            "k_pool": _randn(g, pages, ps, s["kv_heads"], s["head_dim"]),
            "v_pool": _randn(g, pages, ps, s["kv_heads"], s["head_dim"]),
            "page_tables": perm.view(queries, per_seq), "context_lens": lens,
            "scale": torch.tensor(s["head_dim"] ** -0.5)}


def decode_attention(kernels: Kernels, inputs: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    x = _cast(inputs, dtype, keep_fp32=("scale",))
    return [kernels.paged_decode_attention(x["q"], x["k_pool"], x["v_pool"], x["page_tables"], x["context_lens"],
                                           float(x["scale"]))]


def prefill_attention(kernels: Kernels, inputs: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    """A cold prefill of the first sequence's whole context, and a resumed one (its last third new)."""
    x = _cast(inputs, dtype, keep_fp32=("scale",))
    table, length = x["page_tables"][0], int(x["context_lens"][0])
    return [kernels.paged_prefill_attention(x["q_prefill"][-new:], x["k_pool"], x["v_pool"], table, length,
                                            float(x["scale"])) for new in (length, max(1, length // 3))]


def prefill_attention_inputs(s: dict, device: str) -> dict:
    inputs = attention_inputs(s, device, queries=1)
    g = _gen(device, 3)
    length = int(inputs["context_lens"][0])
    inputs["q_prefill"] = _randn(g, length, s["heads"], s["head_dim"])
    return inputs


CASES = {
    "gdn chunked (captures)": ("chunk_gated_delta_rule", gdn_inputs, gdn_chunk),
    "gdn recurrent (batch)": ("recurrent_gated_delta_rule", lambda s, d: gdn_inputs(s, d, batch=s["batch"]),
                              gdn_recurrent),
    "conv prefill (captures)": ("causal_conv1d", conv_inputs, conv_prefill),
    "conv update (batch)": ("causal_conv1d_update", lambda s, d: conv_inputs(s, d, batch=s["batch"]), conv_update),
    "mamba conv prefill": ("mamba_conv1d", lambda s, d: conv_inputs(s, d, channels=s["mamba_channels"]),
                           lambda k, x, t: conv_prefill(k, x, t, mamba=True)),
    "mamba conv update": ("mamba_conv1d_update",
                          lambda s, d: conv_inputs(s, d, batch=s["batch"], channels=s["mamba_channels"]),
                          lambda k, x, t: conv_update(k, x, t, mamba=True)),
    "paged decode attention": ("paged_decode_attention", lambda s, d: attention_inputs(s, d, s["batch"]),
                               decode_attention),
    "paged prefill attention": ("paged_prefill_attention", prefill_attention_inputs, prefill_attention),
}
