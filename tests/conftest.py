"""Shared fixtures: tiny random checkpoints (one per family/layout), written once per test session."""

from __future__ import annotations

import pytest

from tests.checkpoints import FAMILIES, write_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{family: (path, transformers model)} for every family cairn loads."""
    made = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        made[family] = (path, write_checkpoint(family, path))
    return made
