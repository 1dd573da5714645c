"""End to end on the demo model (Gated DeltaNet + gated attention) and on a tiny checkpoint of each Mamba2
family (Nemotron-H: Mamba2 + plain attention + MLP / MoE layers; Granite-4.0-H: Mamba2 + NoPE attention with
MoE + shared MLP and its multipliers; Falcon-H1: attention and Mamba2 in parallel in every layer), fp32:
every divergence pattern real clients produce resumes at the deepest position the placement rules allow,
and its greedy output equals a cold run of the same prompt, with log-probabilities within 1e-4. In half
precision (below) the warm logits equal the cold ones bit for bit.

Placement in these tests: grid every 64 tokens, every chat-message start, every prompt end (with its
logits), every request end, every branch point. Pages of 8 tokens, so resume points fall mid-page.

CI time: every pattern runs in bfloat16 for every family, and a representative subset in float16
(HALF_MATRIX): 44 half-precision runs, about 35 s on a quiet 2-core Xeon (the whole family x pattern x
dtype matrix is 64 runs, past the ~60 s this file may take with its fp32 half); every bf16 pattern again on the
demo model on each CPU path below this machine's best (tests/cpu_paths.py). The layouts left out
here (Granite's dense one, Falcon-H1's tied one) differ in the feed-forward block, biases and the mixer
norm, not in how a resumed computation is cut; test_model_vs_transformers.py runs their contracts.
"""

from __future__ import annotations

import pytest
import torch

from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams
from tests.cpu_paths import PATHS

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
OPTS = dict(kv_cache_gib=0.05, state_cache_gib=0.02, page_size=8, max_num_batched_tokens=96, max_num_seqs=4)
TOL = 1e-4


FAMILIES = ("demo", "nemotron_h", "granitemoehybrid", "falcon_h1")


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request):
    """None (the built-in demo model) or a tiny checkpoint of the family: the patterns hold for every family."""
    if request.param == "demo":
        return None
    return str(request.getfixturevalue("checkpoints")[request.param][0])


@pytest.fixture
def warm(model_dir):
    return LLM(model_dir, **OPTS, device_snapshot_gib=0.1, snapshot_interval=64)


@pytest.fixture(scope="module")
def cold(model_dir):
    return LLM(model_dir, **OPTS, prefix_cache=False)


def text(n: int, seed: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "tool", "result", "plan", "edit", "file", "test", "ok"]
    return " ".join(words[(seed * 7 + i * 3) % len(words)] for i in range(n))


def conversation(turns: int, seed: int = 0) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a careful agent. " + text(12, seed)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"step {t}: " + text(10, seed + t)})
        msgs.append({"role": "assistant", "content": f"done {t}: " + text(8, seed + 2 * t)})
    return msgs


def run(llm: LLM, prompt=None, messages=None):
    engine = llm.engine
    if messages is not None:
        out = llm.chat(messages, GREEDY)[0]
    else:
        out = llm.generate(prompt, GREEDY)[0]
    engine.check_integrity()
    return out


def assert_same_as_cold(cold: LLM, out, prompt=None, messages=None):
    ref = run(cold, prompt, messages)
    assert out.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs, strict=True)) < TOL
    for ours, theirs in zip(out.top_logprobs, ref.top_logprobs, strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ours, theirs, strict=True)) < TOL


def message_starts(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.engine.tokenize_chat(messages)[1]


def test_append_resumes_at_the_end_of_the_previous_request(warm, cold):
    first = list(range(10, 200))
    r1 = run(warm, first)
    second = first + r1.token_ids + [33, 34, 35]
    out = run(warm, second)
    assert out.cache.resume_position == len(first) + len(r1.token_ids) - 1  # the last reply token is computed
    assert out.cache.resume_source == "request_end"
    assert_same_as_cold(cold, out, second)


def test_stripped_reasoning_resumes_at_the_previous_prompt_end(warm, cold):
    msgs = conversation(2)[:-1]  # ends with a user message
    r1 = run(warm, messages=msgs)
    prompt_len = r1.num_prompt_tokens
    other = "X" if r1.token_ids[0] != ord("X") else "Y"  # the client keeps an answer the model did not generate
    nxt = msgs + [{"role": "assistant", "content": other + " final answer"}, {"role": "user", "content": "next"}]
    out = run(warm, messages=nxt)
    assert out.cache.resume_position == prompt_len and out.cache.resume_source == "prompt_end"
    assert_same_as_cold(cold, out, messages=nxt)


def test_compaction_far_back_resumes_at_the_deepest_snapshot_below_the_cut(warm, cold):
    msgs = conversation(8)
    run(warm, messages=msgs)
    ids, starts = warm.engine.tokenize_chat(msgs)
    cut = starts[5] + 13  # inside message 6
    prompt = ids[:cut] + warm.tokenizer.encode("<|im_start|>user\nSummarise the above.<|im_end|>\n")
    out = run(warm, prompt)
    expected = max([p for p in starts if p <= cut] + [64 * (cut // 64)])
    assert out.cache.resume_position == expected and out.cache.match_length == cut
    assert out.cache.miss_reason == "no_snapshot"
    assert_same_as_cold(cold, out, prompt)


def test_edit_mid_history_resumes_at_the_edited_message(warm, cold):
    msgs = conversation(6)
    run(warm, messages=msgs)
    edited = [dict(m) for m in msgs]
    edited[5]["content"] = "step 2: something else entirely"
    out = run(warm, messages=edited)
    start = message_starts(warm, msgs)[4]  # messages[5] starts here (message_starts skips the first message)
    grid = 64 * (out.cache.match_length // 64)
    assert out.cache.resume_position == max(start, grid if grid <= out.cache.match_length else 0)
    assert out.cache.match_length > start
    assert_same_as_cold(cold, out, messages=edited)


def test_regenerating_the_last_reply_computes_nothing_before_the_first_token(warm, cold):
    msgs = conversation(3)[:-1]
    first = run(warm, messages=msgs)
    again = run(warm, messages=msgs)
    assert again.cache.resume_position == again.cache.cached_tokens == first.num_prompt_tokens
    assert again.cache.resume_source == "prompt_end"
    assert again.token_ids == first.token_ids
    assert_same_as_cold(cold, again, messages=msgs)


def test_interleaved_conversations_do_not_destroy_each_other(warm, cold):
    a = list(range(15, 255))
    ra = run(warm, a)
    shared = int(0.6 * len(a))
    b = a[:shared] + [(250 - i) % 200 + 1 for i in range(150)]
    rb = run(warm, b)
    assert rb.cache.resume_position == 64 * (shared // 64)
    a_next = a + ra.token_ids + [7, 8, 9]
    out = run(warm, a_next)
    assert out.cache.resume_position == len(a) + len(ra.token_ids) - 1
    assert_same_as_cold(cold, rb, b)
    assert_same_as_cold(cold, out, a_next)
    b_again = b + rb.token_ids + [1, 2]  # and B's next turn still resumes at B's end
    assert run(warm, b_again).cache.resume_position == len(b) + len(rb.token_ids) - 1


def test_identical_resend_resumes_the_whole_prompt(warm, cold):
    prompt = list(range(40, 170))
    first = run(warm, prompt)
    again = run(warm, prompt)
    assert again.cache.cached_tokens == len(prompt) and again.cache.snapshots_taken <= 1
    assert again.token_ids == first.token_ids
    assert_same_as_cold(cold, again, prompt)


def test_conversations_sharing_a_system_prompt_resume_after_it(warm, cold):
    system = {"role": "system", "content": "Shared instructions. " + text(40, 3)}
    convs = [[system, {"role": "user", "content": f"{'ABCD'[i]} asks: " + text(5, i)}] for i in range(4)]
    outs = [run(warm, messages=c) for c in convs]
    boundary = message_starts(warm, convs[0])[0]  # where the user message starts
    branch = boundary + len(warm.tokenizer.encode("<|im_start|>user\n"))  # where the conversations diverge
    assert outs[0].cache.resume_position == 0
    # the second conversation resumes at the message boundary (or a grid point below the divergence) and
    # leaves a branch snapshot at the divergence point, where every later conversation resumes
    assert outs[1].cache.resume_position == max(boundary, 64 * (branch // 64))
    assert [o.cache.resume_position for o in outs[2:]] == [branch, branch]
    assert [o.cache.resume_source for o in outs[2:]] == ["branch", "branch"]
    for out, conv in zip(outs[1:], convs[1:], strict=True):
        assert_same_as_cold(cold, out, messages=conv)


def test_opted_out_request_neither_reads_nor_writes_the_cache(warm):
    prompt = list(range(50, 150))
    run(warm, prompt)
    params = SamplingParams(max_tokens=4, temperature=0.0, cache_prompt=False)
    out = warm.generate(prompt + [1], params)[0]
    assert out.cache.cached_tokens == 0 and out.cache.miss_reason == "opted_out"
    assert out.cache.snapshots_taken == 0


# ---- half precision: warm == cold bit for bit --------------------------------------------------------------
# With a prefill block (the default in bfloat16 / float16; 64 here, the largest that fits next to the decode
# tokens in a 96-token step) every pattern resumes on a block boundary and computes bit for bit what a cold
# run computes: the logits of every generated token are torch.equal to the cold ones.

HALF = ("bfloat16", "float16")


@pytest.fixture(scope="module")
def cold_half(model_dir):
    return {dtype: LLM(model_dir, **OPTS, dtype=dtype, prefix_cache=False) for dtype in HALF}


def append(llm):
    first = [(i * 7) % 250 + 1 for i in range(190)]
    return first + run(llm, first).token_ids + [33, 34, 35]


def stripped_reasoning(llm):
    msgs = conversation(2)[:-1]
    run(llm, messages=msgs)
    nxt = msgs + [{"role": "assistant", "content": "X final answer"}, {"role": "user", "content": "next"}]
    return llm.engine.tokenize_chat(nxt)[0]


def compaction(llm):
    msgs = conversation(8)
    run(llm, messages=msgs)
    ids, starts = llm.engine.tokenize_chat(msgs)
    return ids[: starts[5] + 13] + llm.tokenizer.encode("<|im_start|>user\nSummarise the above.<|im_end|>\n")


def edit(llm):
    msgs = conversation(6)
    run(llm, messages=msgs)
    edited = [dict(m) for m in msgs]
    edited[5]["content"] = "step 2: something else entirely"
    return llm.engine.tokenize_chat(edited)[0]


def regenerate(llm):
    msgs = conversation(4)[:-1]
    run(llm, messages=msgs)
    return llm.engine.tokenize_chat(msgs)[0]


def resend_of_whole_blocks(llm):
    prompt = [(i * 11) % 240 + 2 for i in range(192)]  # three whole blocks: resumed with its stored logits
    run(llm, prompt)
    return prompt


def interleave(llm):
    a = [(i * 5) % 240 + 3 for i in range(240)]
    ra = run(llm, a)
    run(llm, a[:150] + [(250 - i) % 200 + 1 for i in range(150)])
    return a + ra.token_ids + [7, 8, 9]


def shared_system_prompt(llm):
    system = {"role": "system", "content": "Shared instructions. " + text(40, 3)}
    for i in range(2):
        run(llm, messages=[system, {"role": "user", "content": f"{'AB'[i]} asks: " + text(5, i)}])
    return llm.engine.tokenize_chat([system, {"role": "user", "content": "C asks: " + text(5, 2)}])[0]


PATTERNS = (append, stripped_reasoning, compaction, edit, regenerate, resend_of_whole_blocks, interleave,
            shared_system_prompt)
# every pattern in bfloat16; in float16 the far-back resume (mid-message), the branch beside another
# conversation, and the whole cached prompt resumed with its stored logits
HALF_MATRIX = [(p, "bfloat16") for p in PATTERNS] + [(p, "float16") for p in (compaction, interleave,
                                                                             resend_of_whole_blocks)]


@pytest.mark.parametrize(("pattern", "dtype"), HALF_MATRIX, ids=lambda v: getattr(v, "__name__", v))
def test_half_precision_resume_gives_the_cold_logits_bit_for_bit(pattern, dtype, model_dir, cold_half,
                                                                 sampled_logits):
    warm = LLM(model_dir, **OPTS, dtype=dtype, device_snapshot_gib=0.1, snapshot_interval=64)
    assert warm.engine.prefill_block == 64
    prompt = pattern(warm)
    sampled_logits.clear()
    out = run(warm, prompt)
    warm_rows = torch.stack(sampled_logits)
    sampled_logits.clear()
    ref = run(cold_half[dtype], prompt)
    assert out.cache.resume_position > 0 and out.cache.resume_position % 64 == 0
    assert out.token_ids == ref.token_ids
    assert torch.equal(warm_rows, torch.stack(sampled_logits))


@pytest.fixture(scope="module")
def cold_on_path():
    """A cold bf16 demo engine per CPU path, made on first use."""
    made: dict[str, LLM] = {}
    return lambda path: made.setdefault(path, LLM(None, **OPTS, dtype="bfloat16", prefix_cache=False, cpu_isa=path))


@pytest.mark.parametrize("path", PATHS[:-1])  # the best path ran above (auto); each lower one forced here
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda v: v.__name__)
def test_bf16_resume_gives_the_cold_logits_bit_for_bit_on_every_lower_cpu_path(pattern, path, cold_on_path,
                                                                               sampled_logits):
    """The demo model (every fused op: GDN, norms, silu, attention, the gemv kernel) on each CPU path below this
    machine's best, down to none (the references): warm == cold holds on every path the server offers."""
    warm = LLM(None, **OPTS, dtype="bfloat16", device_snapshot_gib=0.1, snapshot_interval=64, cpu_isa=path)
    assert warm.engine.cpu_path == path
    prompt = pattern(warm)
    sampled_logits.clear()
    out = run(warm, prompt)
    warm_rows = torch.stack(sampled_logits)
    sampled_logits.clear()
    ref = run(cold_on_path(path), prompt)
    assert out.cache.resume_position > 0 and out.cache.resume_position % 64 == 0
    assert out.token_ids == ref.token_ids
    assert torch.equal(warm_rows, torch.stack(sampled_logits))


def test_half_precision_prefill_batched_with_others_gives_the_alone_first_token(cold_half):
    llm = cold_half["bfloat16"]
    prompts = [[(i * k) % 240 + 1 for i in range(n)] for k, n in ((3, 150), (7, 90), (13, 200))]
    alone = [run(llm, p) for p in prompts]
    together = llm.generate(prompts, GREEDY)  # one prefill in the same steps as another's decode steps
    for a, b in zip(alone, together, strict=True):
        assert a.logprobs[0] == b.logprobs[0] and a.top_logprobs[0] == b.top_logprobs[0]
