"""Drive a cairn model directly, without the scheduler: fresh pools, chosen chunk boundaries."""

from __future__ import annotations

import contextlib
import logging

import torch

from cairn.engine.llm import LLM
from cairn.forward_batch import ForwardBatch
from cairn.memory.kv_pool import KVPool
from cairn.memory.state_pool import StatePool
from cairn.memory.state_spec import LayerState, StateSpec, StateTensor
from cairn.model.hybrid import HybridModel
from cairn.request.sampling_params import SamplingParams


def pools(model: HybridModel, num_pages: int = 64, page_size: int = 4, num_slots: int = 4):
    cfg = model.cfg
    dtype = model.embed.weight.dtype
    kv = KVPool(max(len(cfg.attention_layers), 1), num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    states = StatePool(cfg.state_spec(dtype), num_slots)
    return kv, states


def state_pool(num_layers: int = 2, num_slots: int = 2, dtype: torch.dtype = torch.float32) -> StatePool:
    """A small pool of Gated-DeltaNet-shaped slots (conv [8, 3], recurrent [2, 4, 4] fp32 per layer)."""
    entries = (StateTensor("conv", (8, 3), dtype), StateTensor("recurrent", (2, 4, 4), torch.float32))
    return StatePool(StateSpec(tuple(LayerState(i, entries) for i in range(num_layers))), num_slots)


def slot_copy(pool: StatePool, slot: int) -> dict[str, torch.Tensor]:
    """A copy of one slot's named tensors, to compare with later."""
    return {name: t.clone() for name, t in pool.read_slot(slot).items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit, every named tensor."""
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def segment_batch(ids: list[int], start: int, page_table: list[int], slot: int, page_size: int,
                  all_logits: bool = True) -> ForwardBatch:
    """A one-sequence prefill of ids[start:], whose first `start` tokens are already computed."""
    new = ids[start:]
    end = len(ids)
    positions = list(range(start, end))
    return ForwardBatch(
        input_ids=torch.tensor(new), positions=torch.tensor(positions), query_lens=[len(new)], context_lens=[end],
        num_decode=0, page_tables=torch.tensor([page_table[: -(-end // page_size)]]),
        slot_mapping=torch.tensor([page_table[p // page_size] * page_size + p % page_size for p in positions]),
        state_slots=torch.tensor([slot]),
        logits_indices=torch.arange(len(new)) if all_logits else torch.tensor([len(new) - 1]),
    )


def prefill(model: HybridModel, ids: list[int], cuts: list[int] = (), kv=None, states=None, slot: int | None = None,
            page_table: list[int] | None = None, start: int = 0) -> torch.Tensor:
    """Logits of every position of ids[start:], computed in chunks ending at `cuts`."""
    if kv is None:
        kv, states = pools(model, num_pages=-(-len(ids) // 4) + 4)
    if slot is None:
        slot = states.alloc()
    if page_table is None:
        page_table = kv.allocator.alloc(-(-len(ids) // kv.page_size))
    bounds = [c for c in sorted(cuts) if start < c < len(ids)] + [len(ids)]
    out, pos = [], start
    for end in bounds:
        out.append(model(segment_batch(ids[:end], pos, page_table, slot, kv.page_size), kv, states))
        pos = end
    return torch.cat(out)


# Greedy, 6 tokens, with logprobs: what the tier tests compare a resumed answer to a cold one with.
G = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
TOL = 1e-4  # largest logprob difference between a resumed and a cold answer (float32)


def run(llm: LLM, prompt):
    """One greedy answer, with the engine's bookkeeping checked after it."""
    out = llm.generate(prompt, G)[0]
    llm.engine.check_integrity()
    return out


def same_as_cold(cold: LLM, out, prompt) -> None:
    ref = cold.generate(prompt, G)[0]
    assert out.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs, strict=True)) < TOL


def greedy(llm: LLM, prompts: list[list[int]]) -> list:
    """Six greedy tokens per prompt, EOS ignored, with their log-probabilities."""
    return llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True))


def bf16_decode_against_reference(path, fused: dict, reference: dict, exact: bool,
                                  prompt_lens: tuple[int, ...] = (9, 14), cpu_isa: str = "auto") -> None:
    """`greedy` bf16 decoding on the checkpoint at `path`, for a fused CPU op.

    `fused`: Kernels field -> the value a bf16 engine on `cpu_isa` (the instruction path, cairn/ops/cpu_isa.py)
    must have there by default; their calls are counted, so the
    decode goes through them (a family may call only some: Nemotron-H's attention has no q / k norms). A prompt
    decoded in the batch and alone gives the same tokens and log-probabilities, bit for bit. An engine with the
    fields set to `reference` (field -> value) gives the same (`exact`), or else the same first three tokens with
    log-probabilities within 0.05."""
    import dataclasses

    gen = [torch.Generator().manual_seed(n) for n in prompt_lens]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n, g in zip(prompt_lens, gen, strict=True)]
    kw = dict(model=str(path), dtype="bfloat16", device="cpu", kv_cache_gib=0.01, state_cache_gib=0.01,
              cpu_isa=cpu_isa)
    llm, calls = LLM(**kw), {name: 0 for name in fused}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    for name, value in fused.items():
        assert getattr(llm.engine.model.kernels, name) == value, name
    llm.engine.model.kernels = dataclasses.replace(llm.engine.model.kernels,
                                                   **{n: counted(n, v) for n, v in fused.items()})
    batched = greedy(llm, prompts)
    assert any(calls.values()), calls
    alone = [greedy(llm, [p])[0] for p in prompts]
    ref_llm = LLM(**kw)
    ref_llm.engine.model.kernels = dataclasses.replace(ref_llm.engine.model.kernels, **reference)
    for got, one, ref in zip(batched, alone, greedy(ref_llm, prompts), strict=True):
        assert got.token_ids == one.token_ids and got.logprobs == one.logprobs
        if exact:
            assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs
        else:
            assert got.token_ids[:3] == ref.token_ids[:3]
            assert max(abs(x - y) for x, y in zip(got.logprobs[:3], ref.logprobs[:3], strict=True)) < 0.05


def failed_build(module, monkeypatch, tmp_path, what: str) -> str:
    """A build of `module`'s op with no compiler (CXX names a missing file): its one-line reason, which must say
    "building the <what> failed"; `module.load()` then returns it, as on a machine that cannot build the op (the
    module's `_library` too, where it has one)."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    reason = module.load(str(tmp_path))
    assert isinstance(reason, str) and reason.startswith(f"building the {what} failed")
    monkeypatch.setattr(module, "load", lambda: reason)
    if hasattr(module, "_library"):
        monkeypatch.setattr(module, "_library", lambda build_dir: reason)
    return reason


@contextlib.contextmanager
def one_warning_line(caplog, module):
    """Around calls of a fused CPU op's module whose op is refused (a failed build, a failed load check): its
    `_loaded` cache starts and ends empty, and the module says so in exactly one log line, a warning."""
    module._loaded.cache_clear()
    caplog.clear()  # a test may have loaded (and logged) the real op before
    try:
        with caplog.at_level(logging.INFO, logger=module.__name__):
            yield
        lines = [r for r in caplog.records if r.name == module.__name__]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "\n" not in lines[0].getMessage()
    finally:
        module._loaded.cache_clear()
