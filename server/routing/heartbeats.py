"""Application heartbeats for the clients that ask for them in ``subscribe``.

Browsers never see protocol pings, so an SDK's read-timeout watchdog needs frames
it can see. One timer per node sends one frame, encoded once per process, to
every session that asked; no task or timer per socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Set

from protocol.codec import Frame
from protocol.messages import Heartbeat
from server.session import Session, send_frame

HEARTBEAT_FRAME = Frame(Heartbeat())
"""The same bytes for every socket and every tick."""


async def send_heartbeats(sessions: Set[Session], interval: float, outbox_limit: int) -> None:
    """Every ``interval`` seconds, one heartbeat frame to each session in ``sessions``."""
    while True:
        await asyncio.sleep(interval)
        if sessions:
            send_frame(list(sessions), HEARTBEAT_FRAME, outbox_limit)
