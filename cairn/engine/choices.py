"""ChoiceGroups: which sequences (choices) make up each request, and which wait for the first's prefill.

A request with n > 1 is n sequences of one request id (`Sequence.group_id`). When its choices share the
prompt through the prefix cache, only the first is scheduled at once; the others are held until its
prefill is done (`release`), then resume from the snapshot it left. A request is finished when every
choice is and none is still held.

    add(rid, [c0, c1, c2], hold=True)   c0 scheduled by the caller; c1, c2 held
    release(rid)  -> [c1, c2]           c0 produced its first token: the caller queues them
    finish(c0), finish(c1) -> False     finish(c2) -> True: the request is done and forgotten

This is bookkeeping only: it never touches the scheduler, the cache or the outputs (the engine does,
with what these calls return), and it holds no resource that needs freeing.
"""

from __future__ import annotations

from cairn.sequence import Sequence


class ChoiceGroups:
    def __init__(self):
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its choices, until all have finished
        self._held: dict[str, list[Sequence]] = {}  # request id -> choices queued once the first has prefilled

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, request_id: str, choices: list[Sequence], hold: bool) -> None:
        """Record a new request's choices; with `hold`, all but the first wait for `release`.
        Raises ValueError when the id is already in use."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._groups[request_id] = choices
        if hold and len(choices) > 1:
            self._held[request_id] = choices[1:]

    def release(self, request_id: str) -> list[Sequence]:
        """The choices held for this request (to queue now; [] when none): they are no longer held."""
        return self._held.pop(request_id, [])

    def cancel(self, request_id: str) -> list[Sequence]:
        """Stop holding the request's choices and return its unfinished ones, for the caller to finish;
        the request is forgotten when the last of them finishes (`finish`)."""
        self._held.pop(request_id, None)
        return [seq for seq in self._groups.get(request_id, []) if not seq.is_finished]

    def forget(self, request_id: str) -> list[Sequence]:
        """Drop the request at once (a failed step); returns every choice it had ([] when unknown)."""
        self._held.pop(request_id, None)
        return self._groups.pop(request_id, [])

    def finish(self, seq: Sequence) -> bool:
        """`seq` has finished: True when that finishes its whole request (every choice finished, none
        held), which is then forgotten. A choice of an unknown request finishes it alone."""
        group = self._groups.get(seq.group_id, [seq])
        if seq.group_id in self._held or not all(other.is_finished for other in group):
            return False
        self._groups.pop(seq.group_id, None)
        return True
