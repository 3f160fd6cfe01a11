"""The tiers and kinds in tests/conftest.py name files and tests that exist, so a
rename cannot quietly move a slow test into the default tier."""

from __future__ import annotations

import re

import pytest

from tests.conftest import KIND_BY_PATH, SLOW, TESTS


def test_every_slow_entry_names_a_file_and_a_test_in_it() -> None:
    for entry in SLOW:
        path, _, name = entry.partition("::")
        source = (TESTS / path).read_text()
        if name:
            assert re.search(rf"^(async )?def {name}\(", source, re.MULTILINE), entry


def test_every_kind_path_exists() -> None:
    for path in KIND_BY_PATH:
        assert (TESTS / path).exists(), path


def test_the_kinds_are_registered_markers(pytestconfig: pytest.Config) -> None:
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert {"slow", *KIND_BY_PATH.values()} <= registered
