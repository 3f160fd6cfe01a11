"""A test client that applies presence exactly as the live browser client does.

- A snapshot replaces the state.
- A delta with ``seq <= last`` is ignored; one with ``seq > last + 1`` is a
  gap, and the client sends ``syncPresence``; otherwise it applies leaves,
  then joins, and ``totalCount += joins - leaves``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jwt
import msgpack
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

DEV_SECRET = "test-dev-secret-0123456789abcdef-0123"

PATIENCE = 30.0
"""How long a wait for the server lasts by default: a hang guard, never the thing
measured. Generous, for a two-core machine that five test runs share."""

ROUNDTRIP = re.compile(r"ap-test-roundtrip-(\d+)")
"""The unknown action :meth:`Client.barrier` sends, named in the error that answers it."""


def dev_token(user_id: str, *, secret: str = DEV_SECRET, expires_in: int = 600) -> str:
    now = int(time.time())
    return jwt.encode({"sub": user_id, "iat": now, "exp": now + expires_in}, secret, "HS256")


def dev_bot_token(client_id: str, *, secret: str = DEV_SECRET, expires_in: int = 600) -> str:
    """What ``ap-realtime dev-token --bot`` mints."""
    from server.auth.verify import dev_bot_claims

    return jwt.encode(dev_bot_claims(client_id, int(time.time()), expires_in), secret, "HS256")


@dataclass
class Presence:
    seq: int | None = None
    total_count: int = 0  # as the browser computes it
    server_total: int = 0  # the delta's own totalCount, which old browsers ignore
    visible: set[str] = field(default_factory=set)
    snapshots: int = 0
    deltas: list[int] = field(default_factory=list)
    gaps: int = 0


class Client:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.binary = ws.subprotocol == "ap.msgpack"
        self.presence = Presence()
        self.messages: list[dict[str, Any]] = []
        self._changed = asyncio.Condition()
        self._roundtrips = 0
        self._answered: set[int] = set()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, *, msgpack_protocol: bool = False, **kwargs: Any) -> Client:
        subprotocols = [Subprotocol("ap.msgpack")] if msgpack_protocol else None
        # As patient as every other wait here: websockets' own 10 s was once too
        # short for 600 clients moving to one node beside busy loops.
        kwargs.setdefault("open_timeout", PATIENCE)
        ws = await connect(url, subprotocols=subprotocols, **kwargs)
        return cls(ws)

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def send(self, message: dict[str, Any]) -> None:
        if self.binary:
            await self.ws.send(msgpack.packb(message))
        else:
            await self.ws.send(json.dumps(message))

    async def subscribe(
        self,
        user_id: str,
        *,
        invisible: bool = False,
        games: list[tuple[str, str]] | None = None,
        watch_version: int | None = 1,
        wants_presence: bool = True,
        token: str | None = None,
        since: dict[str, Any] | None = None,
        within: float = PATIENCE,
    ) -> None:
        message: dict[str, Any] = {
            "action": "subscribe",
            "token": token if token is not None else dev_token(user_id),
            "invisible": invisible,
        }
        if watch_version is not None:
            message["watchVersion"] = watch_version
        if games is not None:
            message["games"] = [{"meta": m, "id": g} for m, g in games]
        if not wants_presence:
            message["wantsPresence"] = False
        if since is not None:
            message["since"] = since
        snapshots = self.presence.snapshots
        await self.send(message)
        if wants_presence:
            await self.wait_for(lambda: self.presence.snapshots > snapshots, within)
        else:
            await self.barrier(within)

    async def watch(
        self, games: list[tuple[str, str]], *, since: dict[str, Any] | None = None
    ) -> None:
        message: dict[str, Any] = {
            "action": "watchGames",
            "games": [{"meta": m, "id": g} for m, g in games],
        }
        if since is not None:
            message["since"] = since
        await self.send(message)

    def on_stream(self, stream: str) -> list[dict[str, Any]]:
        """Positioned frames (events and skips) of ``stream``, in arrival order."""
        return [m for m in self.messages if m.get("stream") == stream]

    def offsets(self, stream: str) -> list[int]:
        return [m["offset"] for m in self.on_stream(stream)]

    def recovered(self, stream: str) -> list[dict[str, Any]]:
        return [
            m["payload"]
            for m in self.messages
            if m.get("verb") == "recovered" and m["payload"]["stream"] == stream
        ]

    async def wait_recovered(
        self, stream: str, count: int = 1, within: float = PATIENCE
    ) -> dict[str, Any]:
        """The ``count``-th ``recovered`` answer for ``stream``."""
        await self.wait_for(lambda: len(self.recovered(stream)) >= count, within)
        return self.recovered(stream)[count - 1]

    @property
    def reader_state(self) -> str:
        """For a failed test's report: whether frames are still being read, and if not, why."""
        task = self._reader
        if not task.done():
            return "reading"
        if task.cancelled():
            return "cancelled"
        error = task.exception()
        return f"failed: {error!r}" if error is not None else "ended (connection closed)"

    @property
    def frames_received(self) -> int:
        """Every frame read from the server, the answers to :meth:`barrier` included."""
        return len(self.messages) + len(self._answered)

    async def barrier(self, within: float = PATIENCE) -> None:
        """Returns once the server has handled everything sent before it.

        An unknown action is answered with an error frame naming it, in order, and
        at once (``syncPresence`` is answered at most once a second). That answer
        is kept out of :attr:`messages`, so tests never mistake it for an error of
        their own."""
        self._roundtrips += 1
        number = self._roundtrips
        await self.send({"action": f"ap-test-roundtrip-{number}"})
        await self.wait_for(lambda: number in self._answered, within)

    async def sync_presence(self, within: float = PATIENCE) -> None:
        """``syncPresence``, and wait for the snapshot that answers it (at most one a
        second per socket: this may wait that long). It also counts as the user being
        seen (lastSeen)."""
        snapshots = self.presence.snapshots
        await self.send({"action": "syncPresence"})
        await self.wait_for(lambda: self.presence.snapshots > snapshots, within)

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                message = json.loads(data) if isinstance(data, str) else msgpack.unpackb(data)
                if message.get("verb") == "connections":
                    await self._apply_presence(message["payload"])
                answered = _roundtrip_answered(message)
                async with self._changed:
                    if answered is None:
                        self.messages.append(message)
                    else:
                        self._answered.add(answered)
                    self._changed.notify_all()
        except ConnectionClosed:
            pass
        finally:
            async with self._changed:
                self._changed.notify_all()

    async def _apply_presence(self, payload: dict[str, Any]) -> None:
        state = self.presence
        if payload["type"] == "snapshot":
            state.seq = payload["seq"]
            state.total_count = state.server_total = payload["totalCount"]
            state.visible = set(payload["visibleUserIds"])
            state.snapshots += 1
            return
        seq = payload["seq"]
        if state.seq is None or seq <= state.seq:
            return
        if seq > state.seq + 1:
            state.gaps += 1
            with contextlib.suppress(ConnectionClosed):
                await self.send({"action": "syncPresence"})
            return
        state.visible.difference_update(payload["leaves"])
        state.visible.update(payload["joins"])
        state.total_count += len(payload["joins"]) - len(payload["leaves"])
        state.server_total = payload["totalCount"]
        state.seq = seq
        state.deltas.append(seq)

    async def wait_for(self, predicate: Callable[[], bool], within: float = PATIENCE) -> None:
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(predicate)

    async def next_message(
        self, predicate: Callable[[dict[str, Any]], bool], within: float = PATIENCE
    ) -> dict[str, Any]:
        """The first message (already received or not) that matches."""
        found: list[dict[str, Any]] = []

        def match() -> bool:
            for message in self.messages:
                if predicate(message):
                    found.append(message)
                    return True
            return False

        await self.wait_for(match, within)
        return found[0]

    def of_verb(self, verb: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("verb") == verb]

    async def closed(self, within: float = PATIENCE) -> tuple[int | None, str]:
        async with asyncio.timeout(within):
            await self.ws.wait_closed()
        return self.ws.close_code, self.ws.close_reason or ""


def _roundtrip_answered(message: dict[str, Any]) -> int | None:
    """The number of the :meth:`Client.barrier` that ``message`` answers, if it does."""
    payload = message.get("payload")
    if message.get("verb") != "error" or not isinstance(payload, dict):
        return None
    text = payload.get("message")
    found = ROUNDTRIP.search(text) if isinstance(text, str) else None
    if found is None or payload.get("code") != "unknown_action":
        return None
    return int(found.group(1))
