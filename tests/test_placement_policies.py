"""The baseline snapshot placements `--snapshot-policy` selects (and `cairn bench` compares), exactly.

cairn's own placement is checked in test_cache_unit.py; here each baseline's positions are asserted
for one prompt, and a real engine runs with one of them, so what the benchmark reports for a baseline
is what that baseline places. An unknown policy is refused when the engine is built.
"""

from __future__ import annotations

import pytest

from cairn.cache.policy.placement import PlacementInput, PlacementOptions, place, request_end_allowed
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams

# a prompt of 1000 tokens leaving a cached path at 700, which holds a snapshot deeper than that
PROMPT = dict(prompt_len=1000, resume_position=0, match_length=700, path_has_deeper_snapshot=True,
              message_starts=(10, 100, 400, 500, 1200), user_message_starts=(10, 100, 400, 500, 1200))


def _place(policy: str, **kw) -> dict[int, str]:
    inp = {**PROMPT, **{k: v for k, v in kw.items() if k in PlacementInput.__dataclass_fields__}}
    opts = {k: v for k, v in kw.items() if k in PlacementOptions.__dataclass_fields__}
    return place(PlacementInput(**inp), PlacementOptions(policy=policy, interval_tokens=256, **opts))


def test_none_policy_places_nothing_and_keeps_no_request_end():
    assert _place("none") == {}
    assert not request_end_allowed(1024, PlacementOptions(policy="none"))


def test_last_chunk_places_one_snapshot_at_the_last_64_aligned_position_below_the_prompt_end():
    assert _place("last_chunk") == {960: "prompt_end"}  # (1000 - 1) // 64 * 64: no grid, messages or branch
    assert _place("last_chunk", prompt_len=1024) == {960: "prompt_end"}  # never the prompt end itself
    assert _place("last_chunk", resume_position=960) == {}  # nothing past the resume point
    assert _place("last_chunk", prompt_len=64) == {}  # position 0 is no snapshot


def test_last_chunk_keeps_the_request_end_only_on_a_page_boundary():
    opts = PlacementOptions(policy="last_chunk", page_size=16)
    assert request_end_allowed(1024, opts) and not request_end_allowed(1030, opts)


def test_prompt_end_branch_places_the_prompt_end_and_the_branch_point_only():
    assert _place("prompt_end_branch") == {700: "branch", 1000: "prompt_end"}
    assert _place("prompt_end_branch", path_has_deeper_snapshot=False) == {1000: "prompt_end"}
    assert _place("prompt_end_branch", resume_position=800) == {1000: "prompt_end"}  # the branch is below
    assert not request_end_allowed(1024, PlacementOptions(policy="prompt_end_branch"))


def test_user_messages_places_user_message_starts_at_least_min_gap_apart_plus_the_prompt_end():
    # 10 and 100 are closer than 256 to the start, 500 to 400; 1200 is past the prompt
    assert _place("user_messages", min_gap_tokens=256) == {400: "message", 1000: "prompt_end"}
    assert _place("user_messages") == {10: "message", 100: "message", 400: "message", 500: "message",
                                       1000: "prompt_end"}
    assert _place("user_messages", resume_position=450, min_gap_tokens=256) == {1000: "prompt_end"}  # 500: 50 away
    assert not request_end_allowed(1024, PlacementOptions(policy="user_messages"))


def test_unknown_placement_policy_is_refused_when_the_engine_is_built_not_per_request():
    with pytest.raises(ValueError, match="unknown snapshot placement policy 'bogus'"):
        LLM(kv_cache_gib=0.02, state_cache_gib=0.02, snapshot_policy="bogus")


def test_an_engine_under_the_last_chunk_policy_takes_only_its_snapshot():
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, snapshot_policy="last_chunk", snapshot_interval=64)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = [(i * 7) % 200 + 1 for i in range(150)]
    llm.generate([prompt], greedy)
    stats = llm.engine.cache.stats()
    assert stats.taken_by_source == {"prompt_end": 1}  # at 128; no grid point, no request end (153 % 16)
    assert [p for p, _, _ in llm.engine.cache.tree.iter_snapshots()] == [128]
    again = llm.generate([prompt + [5, 6, 7]], greedy)[0]
    assert again.cache.resume_position == 128


def test_the_grid_skips_a_point_within_the_minimum_gap_of_a_message_or_branch_snapshot():
    everywhere = {10: "message", 100: "message", 256: "grid", 400: "message", 500: "message", 512: "grid",
                  700: "branch", 768: "grid", 1000: "prompt_end"}
    assert _place("cairn") == everywhere
    assert _place("cairn", min_gap_tokens=64) == {p: s for p, s in everywhere.items() if p != 512}  # 12 from 500
