"""The layout of a segment's snapshot section: named tensors, back to back, described in its meta.

A snapshot is whatever named tensors the model's state spec holds ("layer0.conv", "layer0.recurrent",
"layer3.ssm", ...); the segment stores their bytes one after another and, in the meta JSON,

    {"tensors": [{"name": "layer0.conv", "dtype": "bfloat16", "shape": [6144, 3], "offset": 0,
                  "nbytes": 36864}, ...]}

with offsets from the start of the section, in order, without gaps, the last ending at the section's
end. `layout_meta` writes that description, `read_layout` checks one read from a file (any departure is
a SegmentError "malformed", so a damaged description is refused like a damaged section). Torch-free:
dtypes are names, and their sizes are the table below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
              "int8": 1, "uint8": 1, "bool": 1}


class LayoutError(ValueError):
    """A snapshot description that does not fit its bytes."""


@dataclass(frozen=True)
class NamedBytes:
    """Where one named tensor lies in a snapshot section."""

    name: str
    dtype: str  # a key of ITEM_BYTES, e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # first byte, from the start of the section
    nbytes: int  # prod(shape) * ITEM_BYTES[dtype]


def layout_meta(tensors: Sequence[tuple[str, str, Sequence[int]]]) -> dict:
    """The meta of a section holding (name, dtype, shape) tensors back to back, in this order."""
    entries, offset = [], 0
    for name, dtype, shape in tensors:
        assert dtype in ITEM_BYTES, f"tensor {name}: a model's state dtype ({dtype!r}) always has a stored form"
        nbytes = math.prod(shape) * ITEM_BYTES[dtype]
        entries.append({"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes})
        offset += nbytes
    return {"tensors": entries}


def read_layout(meta: dict, section_bytes: int) -> list[NamedBytes]:
    """The tensors `meta` describes, checked against a section of `section_bytes`; LayoutError otherwise."""
    raw = meta.get("tensors") if isinstance(meta, dict) and set(meta) == {"tensors"} else None
    if not isinstance(raw, list):
        raise LayoutError("snapshot meta is not {'tensors': [...]}")
    layout, offset, names = [], 0, set()
    for entry in raw:
        item = _entry(entry)
        if item.name in names or item.offset != offset:
            raise LayoutError(f"tensor {item.name}: repeated, or not where the one before ends")
        names.add(item.name)
        layout.append(item)
        offset += item.nbytes
    if offset != section_bytes:
        raise LayoutError(f"tensors cover {offset} bytes of a {section_bytes}-byte section")
    return layout


def _entry(entry) -> NamedBytes:
    keys = {"name", "dtype", "shape", "offset", "nbytes"}
    if not isinstance(entry, dict) or set(entry) != keys:
        raise LayoutError(f"tensor entry {entry!r:.80} lacks {sorted(keys)}")
    name, dtype, shape, offset, nbytes = (entry[k] for k in ("name", "dtype", "shape", "offset", "nbytes"))
    dims_ok = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    if not (isinstance(name, str) and name and isinstance(dtype, str) and dtype in ITEM_BYTES and dims_ok
            and type(offset) is int and type(nbytes) is int and offset >= 0):
        raise LayoutError(f"tensor entry {entry!r:.80} is malformed")
    if nbytes != math.prod(shape) * ITEM_BYTES[dtype]:
        raise LayoutError(f"tensor {name}: {nbytes} bytes for shape {shape} of {dtype}")
    return NamedBytes(name, dtype, tuple(shape), offset, nbytes)
