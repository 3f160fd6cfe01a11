"""The exact pins of constraints.txt (tests/test_constraints.py, tests/test_image.py)."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import Version

CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;]+)$")


def read_pins(path: Path = CONSTRAINTS) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"constraints.txt:{number}: not one exact pin: {line!r}"
        name = canonicalize_name(match["name"])
        assert name not in pins, f"constraints.txt:{number}: {name} pinned twice"
        pins[name] = Version(match["version"])
    return pins
