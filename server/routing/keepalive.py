"""Keepalive pings for all of a node's sockets from one timer, not a task per socket.

websockets' own keepalive is a task per connection that wakes every interval,
pings through its send context and waits for the pong under a timeout: a few
hundred microseconds of coroutine machinery per socket and interval, time the
fan-out then lacks. Here one loop walks the sessions a few times per interval:
a socket is pinged once ``ping_interval`` has passed since its last ping, and
one that has sent nothing at all (pong or frame) for ``ping_timeout`` after a
ping is closed with 1011, as the library would. The ping joins the socket's
frames of the turn, so it never lands after a close frame.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Collection

from protocol.errors import CloseCode
from server.session import Session

PING = bytes((0x89, 0))
"""A final, unmasked ping without payload: the same two bytes for every socket."""

SWEEPS_PER_PERIOD = 8
"""Sessions are walked this often per ``min(ping_interval, ping_timeout)``."""


def start_clock(session: Session, now: float, interval: float) -> None:
    """A new session's first ping comes at a random point of its first interval,
    so that sockets that connected together are not all pinged together."""
    session.heard_at = now
    session.pinged_at = now - random.random() * interval


def sweep(sessions: Collection[Session], now: float, interval: float, timeout: float) -> int:
    """Ping the sessions that are due and close those that went silent; pings sent."""
    pinged = 0
    for session in list(sessions):
        if session.close_task is not None:
            continue
        if session.pinged_at > session.heard_at:
            # Nothing heard since the last ping: wait for it, up to the timeout.
            if now - session.pinged_at > timeout:
                session.close(CloseCode.INTERNAL_ERROR, "keepalive ping timeout")
            continue
        if now - session.pinged_at >= interval and session.send_control(PING):
            session.pinged_at = now
            pinged += 1
    return pinged


async def keep_alive(
    sessions: Collection[Session], ping_interval: float, ping_timeout: float
) -> None:
    """Sweep ``sessions`` until cancelled."""
    loop = asyncio.get_running_loop()
    pause = min(ping_interval, ping_timeout) / SWEEPS_PER_PERIOD
    while True:
        await asyncio.sleep(pause)
        sweep(sessions, loop.time(), ping_interval, ping_timeout)
