"""The fan-out floor: the same frames to the same sockets from a C ``send()`` loop.

``floor.c`` is compiled with ``cc`` into a temporary directory at run time.
It opens as many loopback TCP connections as the run has clients, forks a
reader that drains them, and sends each game's frame to that game's watchers
with one ``send()`` per frame, at the publish rate our server reached. Frames
per CPU-second of the sender is the most any server could deliver here: ours
is reported as a share of it.

Plain TCP, no WebSocket handshake: a server frame is unmasked and our node
runs without extensions, so after the handshake every frame is exactly the
bytes this program sends (``floor_frame`` builds them with our own codec).
The handshake is once per connection and costs nothing per frame, so
leaving it out changes none of the floor's per-frame cost.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.codec import Frame
from protocol.messages import GameEvent, Positioned
from protocol.streams import game_stream

SOURCE = Path(__file__).with_name("floor.c")
SEND_BUFFER_BYTES = 64 * 1024
"""Our server's default ``--socket-send-buffer-bytes``: the floor's sockets get the same."""


class FloorError(RuntimeError):
    pass


def floor_frame(meta: str, game_id: str, offset: int = 1) -> bytes:
    """The complete WebSocket frame our server writes for a publisher's event on a game."""
    payload = {"meta": meta, "id": game_id, "ts": time.time_ns(), "ph": 11}
    event = GameEvent("game", meta, game_id, payload)
    positioned = Positioned(event, game_stream(event.key), "0123456789", offset)
    return Frame(positioned).text_wire


@dataclass
class FloorRun:
    events: int
    frames: int
    bytes: int
    send_failures: int
    wall_s: float
    cpu_s: float

    @property
    def frames_per_cpu_s(self) -> float:
        return self.frames / self.cpu_s if self.cpu_s > 0 else float("nan")

    def figures(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "frames": self.frames,
            "send_failures": self.send_failures,
            "window_s": round(self.wall_s, 3),
            "server_cpu_s": round(self.cpu_s, 4),
            "delivered_per_s": round(self.frames / self.wall_s, 1) if self.wall_s else 0.0,
            "delivered_per_cpu_s": round(self.frames_per_cpu_s, 1),
        }


class Floor:
    """The compiled program, and the plan (who watches what) it sends by."""

    def __init__(
        self,
        sockets: int,
        games: Sequence[tuple[str, str]],
        watching: Sequence[Sequence[int]],
        sender_cpus: Sequence[int] = (),
        reader_cpus: Sequence[int] = (),
    ) -> None:
        """``watching[i]``: the games (indexes into ``games``) socket ``i`` watches."""
        if shutil.which("cc") is None:
            raise FloorError("the C floor needs a C compiler (cc) on PATH")
        self._dir = tempfile.TemporaryDirectory(prefix="ap-floor-")
        root = Path(self._dir.name)
        self.binary = root / "floor"
        self.plan = root / "plan.txt"
        self.frames = root / "frames.bin"
        watchers: list[list[int]] = [[] for _ in games]
        for socket_index, picked in enumerate(watching):
            for game in picked:
                watchers[game].append(socket_index)
        lines = [f"{sockets} {len(games)}"]
        lines += [" ".join(map(str, [len(w), *w])) for w in watchers]
        self.plan.write_text("\n".join(lines) + "\n")
        with self.frames.open("wb") as out:
            for meta, game_id in games:
                frame = floor_frame(meta, game_id)
                out.write(struct.pack("<I", len(frame)) + frame)
        self.sender_cpus = ",".join(map(str, sender_cpus))
        self.reader_cpus = ",".join(map(str, reader_cpus))
        self._compiled = False

    async def compile(self) -> None:
        if self._compiled:
            return
        proc = await asyncio.create_subprocess_exec(
            "cc", "-O2", "-o", str(self.binary), str(SOURCE),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await proc.communicate()
        if proc.returncode != 0:
            raise FloorError(f"cc failed: {output.decode(errors='replace')[-2000:]}")
        self._compiled = True

    async def run(self, seconds: float, events_per_s: float) -> FloorRun:
        """Send for ``seconds`` at ``events_per_s`` (0: as fast as it can)."""
        await self.compile()
        proc = await asyncio.create_subprocess_exec(
            str(self.binary), str(self.plan), str(self.frames), f"{seconds:g}",
            f"{events_per_s:g}", str(SEND_BUFFER_BYTES), self.sender_cpus, self.reader_cpus,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise FloorError(f"the floor failed ({proc.returncode}): {err.decode()[-2000:]}")
        return FloorRun(**json.loads(out.decode().strip().splitlines()[-1]))

    def close(self) -> None:
        self._dir.cleanup()
