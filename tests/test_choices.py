"""ChoiceGroups: the bookkeeping of a request's n choices, without an engine (the engine-level behaviour is in
test_parallel_choices.py)."""

from __future__ import annotations

import dataclasses

import pytest

import cairn.engine.engine
from cairn.engine.choices import ChoiceGroups
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams
from cairn.sequence import Sequence, Status


def request(request_id: str, n: int) -> list[Sequence]:
    return [Sequence(request_id if i == 0 else f"{request_id}#{i}", [1, 2, 3], SamplingParams(n=n),
                     group_id=request_id, index=i) for i in range(n)]


def finish(seq: Sequence) -> None:
    seq.status = Status.FINISHED


def test_held_choices_are_released_once_and_the_request_ends_with_its_last_choice():
    groups, seqs = ChoiceGroups(), request("r", 3)
    groups.add("r", seqs, hold=True)
    finish(seqs[0])
    assert not groups.finish(seqs[0])  # the others are still held: the request is not done
    assert groups.release("r") == seqs[1:]
    assert groups.release("r") == []
    finish(seqs[1])
    assert not groups.finish(seqs[1])
    finish(seqs[2])
    assert groups.finish(seqs[2])
    assert "r" not in groups and len(groups) == 0


def test_without_holding_every_choice_is_scheduled_and_nothing_is_released():
    groups, seqs = ChoiceGroups(), request("r", 2)
    groups.add("r", seqs, hold=False)
    assert groups.release("r") == []
    finish(seqs[1])
    assert not groups.finish(seqs[1])
    finish(seqs[0])
    assert groups.finish(seqs[0]) and "r" not in groups


def test_a_request_id_in_use_is_refused():
    groups = ChoiceGroups()
    groups.add("r", request("r", 1), hold=False)
    with pytest.raises(ValueError, match="already in use"):
        groups.add("r", request("r", 2), hold=True)


def test_cancel_stops_holding_and_returns_the_unfinished_choices():
    groups, seqs = ChoiceGroups(), request("r", 3)
    groups.add("r", seqs, hold=True)
    finish(seqs[0])
    groups.finish(seqs[0])
    assert groups.cancel("r") == seqs[1:]
    assert groups.release("r") == []  # cancelled choices are never queued
    finish(seqs[1])
    assert not groups.finish(seqs[1])
    finish(seqs[2])
    assert groups.finish(seqs[2])
    assert groups.cancel("unknown") == []


def test_forget_drops_the_request_at_once():
    groups, seqs = ChoiceGroups(), request("r", 2)
    groups.add("r", seqs, hold=True)
    assert groups.forget("r") == seqs
    assert "r" not in groups and groups.release("r") == [] and groups.forget("r") == []


def test_a_choice_of_an_unknown_request_finishes_it_alone():
    seq = request("r", 1)[0]
    finish(seq)
    assert ChoiceGroups().finish(seq)


def test_a_choice_failing_in_sampling_finishes_its_whole_request_and_frees_everything(monkeypatch):
    llm = LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4)
    real = cairn.engine.engine.sample_isolated

    def second_row_fails(logits, params, generators, contexts=None):
        sampled = real(logits, params, generators, contexts)
        if len(sampled) > 1:  # the first step with two choices in the batch: fault injected into the second
            sampled[1] = dataclasses.replace(sampled[1], error="injected")
        return sampled

    monkeypatch.setattr(cairn.engine.engine, "sample_isolated", second_row_fails)
    engine = llm.engine
    rid = engine.add_request(list(range(20, 60)), SamplingParams(max_tokens=20, temperature=1.0, n=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    # the failed choice reports the error and the end of the request; its siblings were aborted with it
    assert [(o.finish_reason, o.request_finished) for o in outs if o.finished] == [("error", True)]
    assert rid not in engine.choices and len(engine.choices) == 0
    engine.check_integrity()
