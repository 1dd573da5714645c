"""Where the trained demo model's checkpoint is shipped, and the check of its files before they load.

Torch-free, so that the command line's preflight (cairn.preflight.check_model) checks it before
anything slow. cairn/demo/ trains the checkpoint; cairn.engine.demo serves it by name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cairn.model.config import WeightError

DEMO_CHECKPOINT = Path(__file__).resolve().parent.parent / "demo" / "checkpoint"


def demo_checkpoint(path: Path = DEMO_CHECKPOINT) -> Path:
    """The shipped demo checkpoint's directory, its files checked against its SHA256SUMS (WeightError, one line
    naming the file, for a missing or changed one: a clone without the weights, a partial copy)."""
    sums = path / "SHA256SUMS"
    if not sums.is_file():
        raise WeightError(f"the demo model's checkpoint is missing ({sums}): reinstall cairn, or pass --model")
    for line in sums.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        file = path / name
        if not file.is_file():
            raise WeightError(f"the demo model's checkpoint is missing {file}: reinstall cairn, or pass --model")
        with file.open("rb") as f:
            actual = hashlib.file_digest(f, "sha256").hexdigest()
        if actual != digest:
            raise WeightError(f"the demo model's {file} does not match its SHA256SUMS (sha256 {actual[:12]}..., "
                              f"expected {digest[:12]}...): reinstall cairn, or pass --model")
    return path
