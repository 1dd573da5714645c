"""A prefill chunk deep in a long prompt, in a step that also decodes, pays for its attention work: the
step beside running streams lasts about as long at any depth (cairn/scheduler.py, item 2)."""

from __future__ import annotations

import dataclasses

import torch

from cairn.engine.demo import demo_config
from cairn.engine.llm import LLM
from cairn.model.loader import build_model
from cairn.request.sampling_params import SamplingParams

BUDGET, BLOCK, BREAK_EVEN = 512, 64, 128
STREAM = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [(13 * i) % 250 + 1 for i in range(1600)]


def run(break_even: int, with_stream: bool) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
    """Greedy outputs of (a decoding stream and) the long prompt in bfloat16 with exact-resumption blocks, and
    every step's prefill chunks of the long prompt as (position, tokens, decodes in the step)."""
    llm = LLM(dtype="bfloat16", max_num_batched_tokens=BUDGET, prefill_block=BLOCK, prefix_cache=False,
              kv_cache_gib=0.05, state_cache_gib=0.02, page_size=16, max_num_seqs=4)
    engine = llm.engine
    engine.scheduler.attention_break_even = break_even
    chunks, schedule = [], engine.scheduler.schedule

    def recording():
        batch = schedule()
        for seq, n in zip(batch.seqs[batch.num_decode:], batch.num_new_tokens[batch.num_decode:], strict=True):
            if seq.request_id == long_id:
                chunks.append((seq.num_computed, n, batch.num_decode))
        return batch

    engine.scheduler.schedule = recording
    long_id = None
    if with_stream:
        outs = [llm.engine.add_request([5, 6, 7], STREAM)]
        engine.step()
    else:
        outs = []
    long_id = engine.add_request(PROMPT, LONG)
    outs.append(long_id)
    tokens = {rid: [] for rid in outs}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.delta_token_ids)
    engine.check_integrity()
    llm.close()
    return chunks, [tokens[rid] for rid in outs]


def test_a_deep_prefill_chunk_beside_a_decoding_stream_is_shortened_by_its_depth_and_changes_no_token():
    chunks, outputs = run(BREAK_EVEN, with_stream=True)
    assert all(decodes == 1 for _, _, decodes in chunks[:-1])  # the stream decoded beside every chunk
    for position, n, _ in chunks:
        assert n % BLOCK == 0 or position + n == len(PROMPT)  # whole blocks: exact resumption still holds
        room = (BUDGET - 1) * BREAK_EVEN // (BREAK_EVEN + position)
        assert n <= max(room // BLOCK * BLOCK, BLOCK), (position, n)
    assert chunks[0][1] > 3 * BLOCK and chunks[-2][1] == BLOCK  # full-size at the start, one block when deep
    _, unshortened = run(0, with_stream=True)
    assert outputs == unshortened  # the same tokens, bit for bit, whatever the chunks


def test_a_long_prompt_alone_keeps_full_chunks():
    chunks, _ = run(BREAK_EVEN, with_stream=False)
    assert [n for _, n, _ in chunks[:-1]] == [BUDGET] * (len(PROMPT) // BUDGET)


def test_routed_experts_count_only_the_share_a_token_uses():
    def break_even(experts: int, top_k: int) -> int:
        cfg = dataclasses.replace(demo_config(256), ffn_types=("moe",) * 8, num_experts=experts,
                                  num_experts_per_tok=top_k, moe_intermediate_size=128,
                                  shared_expert_intermediate_size=128)
        return build_model(cfg, torch.float32, torch.device("cpu")).attention_break_even()

    two_of_8, two_of_4, four_of_4 = break_even(8, 2), break_even(4, 2), break_even(4, 4)
    assert abs(two_of_8 - two_of_4) <= 0.01 * two_of_4  # two experts' weights per token either way (routers aside)
    assert four_of_4 > 1.2 * two_of_4
