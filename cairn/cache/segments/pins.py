"""Pins: the read pins a segment store holds while a segment is being read, shared by the disk store
and the Redis store. A pinned key is never evicted; pin() of a key the store does not index takes no pin.

The class using it provides `_lock` (a lock around its index), `_index` (its record of segments: `key in
_index` says whether one is indexed) and `_pins` (key -> pin count > 0).
"""

from __future__ import annotations

from collections.abc import Container


class Pins:
    _lock: object
    _index: Container[bytes]
    _pins: dict[bytes, int]

    def pin(self, key: bytes) -> bool:
        """Protect key from eviction until the matching unpin; False (no pin taken) if it is not indexed."""
        with self._lock:
            if key not in self._index:
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def unpin(self, key: bytes) -> None:
        """Release one successful pin(key); ValueError if there is none."""
        with self._lock:
            if key not in self._pins:
                raise ValueError(f"unpin of a key that is not pinned: {key.hex()[:16]}")
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
