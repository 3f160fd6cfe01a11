"""The docs name what exists: design.md's module map, and the index of docs/."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ("protocol", "server", "apclient", "loadtest")


def _module_map() -> dict[str, set[str]]:
    """Per package, the modules the first column of its table in design.md names."""
    text = (DOCS / "design.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    named: dict[str, set[str]] = {}
    package = ""
    for line in section.splitlines():
        heading = re.match(r"### `(\w+)/`", line)
        if heading:
            package = heading.group(1)
            named[package] = set()
            continue
        cell = re.match(r"\| `([\w/]+\.py)` \|", line)
        if cell and package:
            named[package].add(cell.group(1))
    return named


def test_the_module_map_names_every_module_of_the_packages() -> None:
    named = _module_map()
    assert set(named) == set(PACKAGES)
    for package in PACKAGES:
        base = ROOT / package
        modules = {
            str(path.relative_to(base))
            for path in base.rglob("*.py")
            if path.name != "__init__.py" or str(path.relative_to(base)) in named[package]
        }
        missing = sorted(modules - named[package])
        assert not missing, f"docs/design.md's map of {package}/ leaves out {missing}"


def test_the_module_map_names_no_module_that_is_gone() -> None:
    for package, modules in _module_map().items():
        stale = sorted(m for m in modules if not (ROOT / package / m).is_file())
        assert not stale, f"docs/design.md's map of {package}/ names {stale}, which do not exist"


def test_the_docs_index_lists_every_doc_and_the_readme_links_to_it() -> None:
    index = (DOCS / "README.md").read_text()
    listed = set(re.findall(r"^- \[`[^`]+`\]\(([^)]+)\)", index, flags=re.MULTILINE))
    for doc in DOCS.glob("*.md"):
        if doc.name != "README.md":
            assert doc.name in listed, f"docs/README.md does not list {doc.name}"
    for link in listed:
        assert (DOCS / link).resolve().is_file(), f"docs/README.md links to {link}, not a file"
    assert "docs/README.md" in (ROOT / "README.md").read_text()


CONFLICT_MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", flags=re.MULTILINE)
SOURCE_SUFFIXES = {".md", ".py", ".ts", ".mjs", ".yaml", ".lua", ".toml", ".sh", ".service"}
NOT_OURS = {".venv", "node_modules", ".git", "build", "dist", "__pycache__"}


def _sources() -> Iterator[Path]:
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if name not in NOT_OURS]
        for name in files:
            if Path(name).suffix in SOURCE_SUFFIXES:
                yield Path(folder, name)


def test_no_file_keeps_a_merge_conflict() -> None:
    # A merge once left both sides of a conflict in docs/clients.md.
    kept = [
        f"{path.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}"
        for path in _sources()
        for text in [path.read_text(errors="replace")]
        for match in CONFLICT_MARKER.finditer(text)
    ]
    assert not kept, f"merge conflict markers left in {kept}"
