"""cairn's paged decode attention for CPU (cairn/ops/cpu_attention.py) against an fp64 computation and the reference.

The op is not the reference's bits (SDPA sums in another order), so what must hold is: within bf16 rounding of
the exact result (no worse than the reference's own error) on every shape it takes (contexts inside one part of
positions and across several, page sizes, grouped queries of any group size, head sizes the vector body takes and
the scalar one); a sequence's output the same bits alone, in any batch and on any thread count (decode is
batch-independent); pages read where the table says, in place. In the engine, bf16 greedy decoding with it is
batch-independent and stays near the reference. Its dispatch: other dtypes keep the reference, a failed build
leaves the reference in one log line, and the op refuses a context its table does not cover.
"""

from __future__ import annotations

import pytest
import torch

from cairn import ops
from cairn.ops import attention, cpu_attention
from tests.cpu_paths import COMPILED, FLAGS
from tests.harness import bf16_decode_against_reference, failed_build, one_warning_line

per_path = pytest.mark.parametrize("path", COMPILED)

SCALE = 0.0625


def library():
    got = cpu_attention._loaded()
    if got is None:
        pytest.skip(f"the paged decode attention op is not used here: {cpu_attention.load()}")
    return got


def pools(num_pages: int, page_size: int, kv_heads: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, kv_heads, head_dim)
    return (torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())


def scattered_tables(batch: int, max_pages: int, num_pages: int, seed: int = 1) -> torch.Tensor:
    """A table per sequence of distinct pages in random order (never consecutive ids)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_pages, generator=gen)[:max_pages] for _ in range(batch)])


def exact(q, k_pool, v_pool, tables, lens, scale=SCALE) -> torch.Tensor:
    """fp64 attention of each query row over its sequence's keys and values, grouped queries expanded."""
    out = []
    for b in range(q.shape[0]):
        k = attention.gather_pages(k_pool.double(), tables[b], int(lens[b]))
        v = attention.gather_pages(v_pool.double(), tables[b], int(lens[b]))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        weights = (torch.einsum("hd,shd->hs", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hs,shd->hd", weights, v))
    return torch.stack(out)


@pytest.mark.parametrize("lens, page_size, heads, kv_heads, head_dim", [
    ((1,), 16, 8, 2, 256),            # one position
    ((48, 255, 256, 257), 16, 8, 2, 256),  # one part, a part exactly, one position into the next
    ((700, 3), 8, 6, 1, 64),          # several parts; a group of 6 (four heads, then two)
    ((300,), 8, 3, 3, 24),            # no grouping; 24 values: the last run of 16 is a run of 8
    ((90, 33), 16, 6, 2, 20),         # a head size the vector body does not take: the scalar body
])
@per_path
def test_op_is_within_bf16_rounding_of_the_exact_attention(lens, page_size, heads, kv_heads, head_dim, path):
    library()
    max_pages = -(-max(lens) // page_size)
    k_pool, v_pool = pools(len(lens) * max_pages + 3, page_size, kv_heads, head_dim)
    tables = scattered_tables(len(lens), max_pages, k_pool.shape[0])
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(2)).bfloat16()
    lens = torch.tensor(lens)
    want = exact(q, k_pool, v_pool, tables, lens)
    got = cpu_attention.paged_decode_attention(q, k_pool, v_pool, tables, lens, SCALE, path)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    error = (got.double() - want).abs()
    assert (error <= want.abs() * 2 ** -8 + 1e-4).all()  # the output's own rounding: half a bf16 ulp
    reference_error = (attention.paged_decode_attention(q, k_pool, v_pool, tables, lens, SCALE).double() - want).abs()
    assert error.max() <= reference_error.max() * 1.25 + 1e-6


@per_path
def test_vector_body_is_avx2_on_every_compiled_path_where_the_head_size_fits(path):
    library()
    vector = "avx2" if {"avx2", "fma"} <= FLAGS else "generic"
    assert cpu_attention.vector_body(256, path) == cpu_attention.vector_body(24, path) == vector
    assert cpu_attention.vector_body(20, path) == cpu_attention.vector_body(256, "none") == "generic"


@per_path
def test_a_sequence_gives_the_same_bits_alone_in_a_batch_and_on_any_thread_count(path):
    library()
    lens = torch.tensor([600, 17, 256, 1, 300])
    k_pool, v_pool = pools(5 * 38, 16, 2, 256)
    tables = scattered_tables(5, 38, k_pool.shape[0])
    q = torch.randn(5, 8, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(cpu_attention.paged_decode_attention(q, k_pool, v_pool, tables, lens, SCALE, path))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(run.view(torch.int16), runs[0].view(torch.int16)) for run in runs)
    for b in range(5):
        alone = cpu_attention.paged_decode_attention(q[b:b + 1], k_pool, v_pool, tables[b:b + 1], lens[b:b + 1], SCALE,
                                                     path)
        assert torch.equal(alone.view(torch.int16), runs[0][b:b + 1].view(torch.int16))


@per_path
def test_pages_are_read_where_the_table_says(path):
    """The same keys and values on consecutive pages and scattered over a pool give the same bits."""
    library()
    k_pool, v_pool = pools(12, 8, 2, 64)
    near = torch.arange(12)
    far = torch.randperm(40, generator=torch.Generator().manual_seed(4))[:12]
    k_far, v_far = torch.zeros(40, 8, 2, 64, dtype=torch.bfloat16), torch.zeros(40, 8, 2, 64, dtype=torch.bfloat16)
    k_far[far], v_far[far] = k_pool, v_pool
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    lens = torch.tensor([93])
    assert torch.equal(cpu_attention.paged_decode_attention(q, k_pool, v_pool, near[None], lens, SCALE, path),
                       cpu_attention.paged_decode_attention(q, k_far, v_far, far[None], lens, SCALE, path))


def test_op_refuses_a_context_its_table_does_not_cover():
    """A length past the table's pages (or none), or a page id outside the pool, would read another sequence's
    pages or past the pool: refused with the reason, not read."""
    op = library()
    k_pool, v_pool = pools(4, 8, 1, 16)
    q, tables = torch.zeros(1, 2, 16, dtype=torch.bfloat16), torch.tensor([[0, 1]])
    for bad in (17, 0):
        with pytest.raises(RuntimeError, match="context length"):
            op.paged_decode(q, k_pool, v_pool, tables, torch.tensor([bad]), SCALE, 2)
    for page in (4, -1):
        with pytest.raises(RuntimeError, match=f"page id {page} outside the pool"):
            op.paged_decode(q, k_pool, v_pool, torch.tensor([[0, page]]), torch.tensor([9]), SCALE, 2)
    assert op.paged_decode(q, k_pool, v_pool, torch.tensor([[0, 4]]), torch.tensor([8]), SCALE, 2).shape == q.shape


@per_path
def test_other_dtypes_and_pool_views_keep_the_reference(monkeypatch, path):
    monkeypatch.setattr(cpu_attention, "_loaded", lambda: pytest.fail("the op was asked for a tensor it does not take"))
    k_pool, v_pool = pools(4, 8, 2, 16)
    tables, lens = torch.tensor([[2, 0]]), torch.tensor([11])
    for dtype in (torch.float32, torch.float16):
        q, k, v = (t.to(dtype) for t in (torch.randn(1, 4, 16), k_pool, v_pool))
        assert torch.equal(cpu_attention.paged_decode_attention(q, k, v, tables, lens, SCALE, path),
                           attention.paged_decode_attention(q, k, v, tables, lens, SCALE))
    q = torch.randn(1, 4, 16).bfloat16()
    k_view, v_view = k_pool[:, :, :1], v_pool[:, :, :1]  # not contiguous
    assert torch.equal(cpu_attention.paged_decode_attention(q, k_view, v_view, tables, lens, SCALE, path),
                       attention.paged_decode_attention(q, k_view, v_view, tables, lens, SCALE))


def test_op_falls_back_to_the_reference_in_one_line_when_it_does_not_build(caplog, monkeypatch, tmp_path):
    path = "avx2"
    failed_build(cpu_attention, monkeypatch, tmp_path, "paged decode attention op")
    with one_warning_line(caplog, cpu_attention):
        k_pool, v_pool = pools(4, 8, 2, 16)
        q, tables, lens = torch.randn(1, 4, 16).bfloat16(), torch.tensor([[1, 3]]), torch.tensor([12])
        for _ in range(2):
            assert torch.equal(cpu_attention.paged_decode_attention(q, k_pool, v_pool, tables, lens, SCALE, path),
                               attention.paged_decode_attention(q, k_pool, v_pool, tables, lens, SCALE))


@per_path
def test_engine_decodes_bf16_through_the_op_batch_independently_and_near_the_reference(checkpoints, path):
    library()
    field = "paged_decode_attention"
    bf16_decode_against_reference(checkpoints["qwen3_5"][0],
                                  {field: ops.CpuOp(cpu_attention.paged_decode_attention, path)},
                                  {field: attention.paged_decode_attention}, exact=False, prompt_lens=(9, 30),
                                  cpu_isa=path)
