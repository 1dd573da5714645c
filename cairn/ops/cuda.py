"""Fast CUDA kernels from the field, behind the reference kernels' contracts (opt-in: --fast-kernels).

Three libraries, each imported lazily and only when asked for, each standing in for the reference
kernels it covers when it imports (the reference stays for the rest, with one log line per library
that does not import):

    flash-linear-attention (`fla`)   chunked and recurrent gated delta rule (this module)
    causal-conv1d                    the causal conv of Gated DeltaNet and Mamba2 (cairn/ops/cuda_conv.py)
    flashinfer                       paged decode and prefill attention, pages read in place
                                     (cairn/ops/cuda_attention.py)

`fla`'s gated delta rule is adapted to the contracts in cairn/ops/gdn.py: token-major inputs of one
sequence (prefill) or a batch (decode), the fp32 state updated where it lies, and states captured
inside a prefill segment, which `fla` cannot return, obtained by splitting the segment at the capture
points (each piece continues the state of the one before).

UNTESTED ON GPU: no GPU was available when this was written. The CPU tests check the adapters against
the references with a stand-in that has `fla`'s signature; the first GPU run must compare them with
the reference kernels (1e-3 in bf16) before anyone turns them on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cairn.ops import conv, gdn
from cairn.ops.optional import import_optional


def make_chunk(fla_chunk: Callable) -> Callable:
    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, capture_at: Sequence[tuple[int, torch.Tensor]] = ()):
        seq_len, num_v_heads = v.shape[0], v.shape[1]
        q, k = gdn._expand_heads(q, k, num_v_heads)  # fla takes [batch, time, heads, dim], q / k per value head
        conv.check_captures(capture_at, seq_len)
        cuts = sorted({c for c, _ in capture_at if c < seq_len}) + [seq_len]
        state, pieces, start = initial_state.float(), [], 0
        for end in cuts:
            piece = slice(start, end)
            o, state = fla_chunk(q[None, piece], k[None, piece], v[None, piece], g[None, piece].float(),
                                 beta[None, piece], scale=q.shape[-1] ** -0.5,
                                 initial_state=state[None].contiguous(), output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
            state = state[0].float()
            pieces.append(o[0])
            for count, dst in capture_at:
                if count == end:
                    dst.copy_(state)
            start = end
        return torch.cat(pieces).to(v.dtype), state

    return chunk_gated_delta_rule


def make_recurrent(fla_recurrent: Callable) -> Callable:
    def recurrent_gated_delta_rule(q, k, v, g, beta, state):
        q, k = gdn._expand_heads(q, k, state.shape[1])
        o, final = fla_recurrent(q[:, None], k[:, None], v[:, None], g[:, None].float(), beta[:, None],
                                 scale=q.shape[-1] ** -0.5, initial_state=state.contiguous(),
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
        state.copy_(final)  # the contract: updated where it lies (a view of the state pool)
        return o[:, 0].to(v.dtype), state

    return recurrent_gated_delta_rule


def load_fla():
    """fla's gated delta rule module, or None when it is not installed (or fails to import)."""
    return import_optional("fla.ops.gated_delta_rule", "flash-linear-attention", "reference gated delta rule")


def fla_kernels() -> dict[str, Callable]:
    """The gated delta rule fields of cairn.ops.Kernels that fla provides (empty when it does not import)."""
    fla = load_fla()
    if fla is None:
        return {}
    return {"chunk_gated_delta_rule": make_chunk(fla.chunk_gated_delta_rule),
            "recurrent_gated_delta_rule": make_recurrent(fla.fused_recurrent_gated_delta_rule)}


def kernels() -> tuple[str, dict[str, Callable]] | None:
    """(name, the fast kernels that import by their field name in cairn.ops.Kernels), the reference standing
    in for the others; None when no library imports. The name lists the libraries: "cuda[fla+flashinfer]"."""
    from cairn.ops import cuda_attention, cuda_conv

    chosen, libraries = {}, []
    for library, fields in (("fla", fla_kernels()), ("causal-conv1d", cuda_conv.kernels()),
                            ("flashinfer", cuda_attention.kernels())):
        if fields:
            chosen.update(fields)
            libraries.append(library)
    return (f"cuda[{'+'.join(libraries)}]", chosen) if chosen else None
