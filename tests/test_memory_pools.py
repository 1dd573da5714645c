"""The memory pools' refusals, each where a caller that did not check first meets it: more KV pages or state
slots than are free (refused whole, nothing taken), and a slot copied into a pool of another layout.

The cache and the scheduler check `num_free` before they allocate, so in the engine these fire only on a
bug; what matters is that they refuse cleanly, leaving the pool as it was.
"""

from __future__ import annotations

import pytest

from cairn.memory.pages import OutOfPages, PageAllocator
from cairn.memory.state_pool import OutOfSlots
from tests.harness import same_state, slot_copy, state_pool


def test_asking_more_pages_than_are_free_raises_and_takes_none():
    pages = PageAllocator(4)
    held = pages.alloc(3)
    with pytest.raises(OutOfPages, match="asked for 2 KV pages, 1 free of 4"):
        pages.alloc(2)
    assert pages.num_free == 1 and pages.alloc(1) not in held  # the refused call took nothing
    with pytest.raises(OutOfPages):
        pages.reserve()  # the scratch page of CUDA graphs, asked of a full pool
    pages.check_integrity(dict.fromkeys(range(4), 1))


def test_asking_a_slot_when_none_is_free_raises_out_of_slots_and_takes_none():
    states = state_pool(num_slots=2)
    held = {states.alloc(), states.alloc()}
    with pytest.raises(OutOfSlots, match="all 2 state slots are in use"):
        states.alloc()
    with pytest.raises(OutOfSlots):
        states.reserve()
    assert states.reserved == [] and states.num_usable == 2
    states.free(held.pop())
    assert states.num_free == 1


def test_a_slot_is_never_copied_into_a_pool_of_another_layout():
    two_layers, three_layers = state_pool(num_layers=2), state_pool(num_layers=3)
    src, dst = two_layers.alloc(), three_layers.alloc()
    with pytest.raises(ValueError, match="different specs"):
        two_layers.copy_to(src, three_layers, dst)
    for t in two_layers.read_slot(src).values():
        t.normal_()
    same_layout = state_pool(num_layers=2, num_slots=1)  # an equal spec, another object: the copy goes ahead
    assert same_layout.spec is not two_layers.spec
    copy = same_layout.alloc()
    two_layers.copy_to(src, same_layout, copy)
    assert same_state(slot_copy(same_layout, copy), slot_copy(two_layers, src))


def test_a_page_freed_twice_or_referenced_after_its_free_is_refused_and_the_counts_stay():
    """A double free or a use after free (a bug in a page's owner) raises at the call instead of counting a free
    page below zero or back into use: the free list and refcounts still agree, and the page is handed out once."""
    pages = PageAllocator(3)
    kept, freed = pages.alloc(2)
    assert pages.decref([freed]) == 1
    with pytest.raises(AssertionError, match=f"decref of free page {freed}"):
        pages.decref([freed])
    with pytest.raises(AssertionError, match=f"incref of free page {freed}"):
        pages.incref([freed])
    pages.check_integrity({kept: 1})
    assert sorted(pages.alloc(2)) == [freed, 2] and pages.num_free == 0


def test_the_reserved_scratch_page_and_slot_are_never_freed_and_a_slot_is_never_freed_twice():
    """The CUDA graph path's scratch page and slot (reserve) hold a reference nothing releases: a release of
    either, like a second free of a slot, is a bug in its owner and raises, leaving the pool as it was."""
    pages = PageAllocator(2)
    scratch = pages.reserve()
    with pytest.raises(AssertionError, match=f"decref of reserved page {scratch}"):
        pages.decref([scratch])
    pages.check_integrity({})  # the reserved page's own reference is all it holds
    states = state_pool(num_slots=3)
    scratch_slot, freed = states.reserve(), states.alloc()
    states.free(freed)
    for slot in (scratch_slot, freed, 7):
        with pytest.raises(AssertionError, match=f"free of slot {slot} that is not allocated"):
            states.free(slot)
    assert states.num_free == 2 and states.num_usable == 2
