"""constraints.txt: the exact versions CI passed with, and what the tests run on.

A fresh clone installs through it (scripts/bootstrap, the README's command, the
Dockerfile), so a release on PyPI cannot change what a clean CI run gets. These
checks keep it whole: every distribution the project pulls in is pinned, each pin
lies in pyproject.toml's range, and the environment running the tests is the
pinned one (the image test checks the image's).
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.pins import read_pins

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "ap-realtime"
INSTALLER_TOOLS = {"pip", "setuptools", "wheel"}
"""Part of the venv, not of the project; ``pip freeze`` leaves them out."""


def project_requirements() -> list[Requirement]:
    """The server's requirements and every extra's, this project's own extras left out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        lines.extend(extra)
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if canonicalize_name(r.name) != PROJECT]


def applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    # A dependency of an extra carries ``extra == "..."`` in its marker; the rest of
    # the environment is this interpreter's.
    return any(requirement.marker.evaluate({"extra": extra}) for extra in extras | {""})


def installed_closure(roots: list[Requirement]) -> dict[str, str]:
    """Every distribution ``roots`` pull in here, with its installed version."""
    found: dict[str, str] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    todo = [r for r in roots if applies(r, set())]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        extras = frozenset(requirement.extras)
        if (name, extras) in visited:
            continue
        visited.add((name, extras))
        distribution = metadata.distribution(requirement.name)
        found[name] = distribution.version
        todo.extend(
            child
            for child in map(Requirement, distribution.requires or [])
            if applies(child, set(extras))
        )
    return found


def test_every_line_is_one_exact_pin_of_a_distinct_distribution() -> None:
    pins = read_pins()
    assert len(pins) > 50  # the whole tree, not only the direct requirements


def test_the_reader_refuses_a_range_and_a_repeat(tmp_path: Path) -> None:
    ranged = tmp_path / "ranged.txt"
    ranged.write_text("# header\nwebsockets>=15\n")
    repeated = tmp_path / "repeated.txt"
    repeated.write_text("Flask==3.1.3\nflask==3.1.3\n")
    for path, message in ((ranged, "not one exact pin"), (repeated, "pinned twice")):
        with pytest.raises(AssertionError, match=message):
            read_pins(path)


def test_each_requirement_of_pyproject_is_pinned_inside_its_range() -> None:
    pins = read_pins()
    for requirement in project_requirements():
        if not applies(requirement, set()):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )


def test_the_tests_run_on_exactly_the_pinned_versions() -> None:
    pins = read_pins()
    closure = installed_closure(project_requirements())
    for name in INSTALLER_TOOLS:
        closure.pop(name, None)
    unpinned = sorted(set(closure) - set(pins))
    assert not unpinned, f"installed for the project but not pinned: {unpinned}"
    drifted = {
        name: (version, str(pins[name]))
        for name, version in closure.items()
        if Version(version) != pins[name]
    }
    assert not drifted, f"installed, pinned (run scripts/bootstrap): {drifted}"
