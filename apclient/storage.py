"""Where stream positions are kept between runs: in memory (the default) or a file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from protocol.messages import Position

log = logging.getLogger("apclient")

MAX_STREAMS = 2000
"""Positions kept; past it the stream that moved least recently goes first."""


class Storage(Protocol):
    """Any object with these two methods; ``save`` gets every position each time."""

    def load(self) -> dict[str, Position]: ...

    def save(self, positions: Mapping[str, Position]) -> None: ...


class MemoryStorage:
    """Positions for the life of the process (and of this object)."""

    def __init__(self) -> None:
        self.positions: dict[str, Position] = {}

    def load(self) -> dict[str, Position]:
        return dict(self.positions)

    def save(self, positions: Mapping[str, Position]) -> None:
        self.positions = dict(positions)


class FileStorage:
    """Positions in a JSON file, replaced atomically on every save, so a bot that
    restarts recovers from what its handlers had finished."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Position]:
        try:
            stored = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("positions in %s unreadable, starting afresh: %s", self.path, exc)
            return {}
        positions: dict[str, Position] = {}
        if isinstance(stored, dict):
            for stream, value in stored.items():
                if (
                    isinstance(value, list)
                    and len(value) == 2
                    and isinstance(value[0], str)
                    and isinstance(value[1], int)
                ):
                    positions[stream] = Position(value[0], value[1])
        return positions

    def save(self, positions: Mapping[str, Position]) -> None:
        data = json.dumps({s: [p.epoch, p.offset] for s, p in positions.items()})
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        try:
            with os.fdopen(handle, "w") as out:
                out.write(data)
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def storage_for(value: Storage | str | os.PathLike[str] | None) -> Storage:
    if value is None:
        return MemoryStorage()
    if isinstance(value, str | os.PathLike):
        return FileStorage(value)
    return value
