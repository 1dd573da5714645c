"""ChoiceGroups: the bookkeeping of a request's n choices, without an engine (the engine-level behaviour is in
test_parallel_choices.py)."""

from __future__ import annotations

import pytest

from cairn.choices import ChoiceGroups
from cairn.sampling import SamplingParams
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
