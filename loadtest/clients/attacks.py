"""The attackers of the ``abuse`` scenario: bare WebSocket clients that each do one bad thing.

Each :class:`Attacker` speaks just enough RFC 6455 to upgrade, write frames
and read the server's answers (error frames, the close frame, pings), and
records how its connection ended: the close code it read, a drop without
one, an HTTP status instead of the upgrade, or still open. Every attack is
bounded in frames and in time.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from loadtest.clients.sim import OP_CLOSE, OP_PING, OP_PONG, OP_TEXT, encode_frame

TokenFor = Callable[[str], str]


class Attacker(asyncio.Protocol):
    def __init__(self, host: str, port: int, *, reading: bool = True) -> None:
        self.host = host
        self.port = port
        self.reading = reading
        self.transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.status: int | None = None
        self.close_code: int | None = None
        self.errors: list[str] = []
        self.frames_read = 0
        self._buffer = b""
        self._upgraded = False
        self._key = base64.b64encode(os.urandom(16))

    @classmethod
    async def open(
        cls, host: str, port: int, *, reading: bool = True, rcvbuf: int | None = None
    ) -> Attacker:
        attacker = cls(host, port, reading=reading)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so the window stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), 10)
            await loop.create_connection(lambda: attacker, sock=sock)
            await asyncio.wait_for(asyncio.shield(attacker.opened), 10)
        except (OSError, TimeoutError, ConnectionError):
            sock.close()
            if not attacker.lost.done():
                attacker.lost.set_result(None)
        return attacker

    # --- outcome --------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._upgraded and not self.lost.done()

    @property
    def outcome(self) -> str:
        if self.status is not None and self.status != 101:
            return f"http {self.status}"
        if self.close_code is not None:
            return f"close {self.close_code}"
        if self.lost.done():
            return "dropped" if self._upgraded else "failed"
        return "open"

    async def finish(self, within: float) -> str:
        """Read again (a non-reader too) and wait up to ``within`` s for the end."""
        if self.transport is not None and not self.reading:
            self.reading = True
            with contextlib.suppress(Exception):
                self.transport.resume_reading()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.lost), within)
        return self.outcome

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # --- writing --------------------------------------------------------------

    def send_text(self, text: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(OP_TEXT, text.encode()))

    def send_json(self, message: dict[str, Any]) -> None:
        self.send_text(json.dumps(message))

    def send_raw(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    @property
    def backlog(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    # --- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(
            (
                f"GET / HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {self._key.decode()}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_result(None)
        if not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        data = self._buffer + data
        if not self._upgraded:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self._buffer = data
                return
            self.status = int(data.split(b" ", 2)[1])
            if self.status != 101:
                assert self.transport is not None
                self.transport.close()
                return
            self._upgraded = True
            self.opened.set_result(None)
            data = data[end + 4 :]
            if not self.reading and self.transport is not None:
                self.transport.pause_reading()
        self._buffer = self._frames(data)

    def _frames(self, data: bytes) -> bytes:
        """Handle every whole frame in ``data``; return the rest."""
        while len(data) >= 2:
            opcode = data[0] & 0x0F
            length = data[1] & 0x7F
            offset = 2
            if length == 126:
                if len(data) < 4:
                    break
                length = struct.unpack("!H", data[2:4])[0]
                offset = 4
            elif length == 127:
                if len(data) < 10:
                    break
                length = struct.unpack("!Q", data[2:10])[0]
                offset = 10
            if len(data) < offset + length:
                break
            payload = data[offset : offset + length]
            data = data[offset + length :]
            self.frames_read += 1
            self._frame(opcode, payload)
        return data

    def _frame(self, opcode: int, payload: bytes) -> None:
        assert self.transport is not None
        if opcode == OP_TEXT and payload.startswith(b'{"verb":"error"'):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.errors.append(json.loads(payload)["payload"]["code"])
        elif opcode == OP_PING:
            self.send_raw(encode_frame(OP_PONG, payload))
        elif opcode == OP_CLOSE:
            if len(payload) >= 2 and self.close_code is None:
                self.close_code = struct.unpack("!H", payload[:2])[0]
            self.send_raw(encode_frame(OP_CLOSE, payload[:2]))
            self.transport.close()


# --- the attacks ----------------------------------------------------------------


@dataclass
class Attack:
    """One kind of abuse: ``count`` attackers, and the outcomes that are correct."""

    name: str
    description: str
    expected: tuple[str, ...]
    count: int
    run: Callable[[AttackContext], Awaitable[list[Attacker]]]
    seconds: float = 4.0
    """How long it attacks, at the default --duration of 4 s (scaled with it)."""
    grace: float = 8.0
    """How long its attackers may then wait for their end (--close-timeout plus a margin)."""
    open_allowed: int = 0
    """Attackers that may rightly stay open (the per-user cap lets its first ones in)."""

    def outcome(self, attacker: Attacker) -> str:
        if self.name == "odd_game_ids" and "invalid_message" in attacker.errors:
            return "refused"  # an error frame, and the socket may stay
        return attacker.outcome


@dataclass
class AttackContext:
    host: str
    port: int
    http: tuple[str, int]
    publish_secret: str
    token_for: TokenFor
    count: int
    seconds: float
    games: Sequence[tuple[str, str]]
    rng: random.Random
    notes: dict[str, Any] = field(default_factory=dict)


async def _open_many(ctx: AttackContext, count: int, **kwargs: Any) -> list[Attacker]:
    return list(
        await asyncio.gather(*(Attacker.open(ctx.host, ctx.port, **kwargs) for _ in range(count)))
    )


async def _flood(attackers: Sequence[Attacker], frame: bytes, frames: int, seconds: float) -> None:
    """Write ``frames`` copies of ``frame`` on each attacker as fast as the socket takes them."""
    end = time.monotonic() + seconds
    batch = frame * 200
    sent = 0
    while sent < frames and time.monotonic() < end:
        live = [a for a in attackers if a.is_open]
        if not live:
            return
        for attacker in live:
            if attacker.backlog < 1 << 20:
                attacker.send_raw(batch)
        sent += 200
        await asyncio.sleep(0.001)


def _subscribe(attacker: Attacker, ctx: AttackContext, user: str, **extra: Any) -> None:
    attacker.send_json({"action": "subscribe", "token": ctx.token_for(user), **extra})


async def junk_flood(ctx: AttackContext) -> list[Attacker]:
    """Unauthenticated sockets sending 20,000 junk frames each."""
    attackers = await _open_many(ctx, ctx.count)
    await _flood(attackers, encode_frame(OP_TEXT, b'{"action":"dance"}'), 20_000, ctx.seconds)
    return attackers


async def sync_flood(ctx: AttackContext) -> list[Attacker]:
    """Subscribed sockets asking for presence snapshots 20,000 times each."""
    attackers = await _open_many(ctx, ctx.count)
    for index, attacker in enumerate(attackers):
        _subscribe(attacker, ctx, f"atk-sync-{index}", watchVersion=1, games=[])
    await asyncio.sleep(0.2)
    await _flood(
        attackers, encode_frame(OP_TEXT, b'{"action":"syncPresence"}'), 20_000, ctx.seconds
    )
    return attackers


async def watch_churn(ctx: AttackContext) -> list[Attacker]:
    """Subscribed sockets replacing a 1,000-game watch set in a loop."""
    attackers = await _open_many(ctx, ctx.count)
    for index, attacker in enumerate(attackers):
        _subscribe(attacker, ctx, f"atk-watch-{index}", watchVersion=1, games=[])
    await asyncio.sleep(0.2)
    frames = []
    for _ in range(4):
        games = [{"meta": "atk", "id": str(ctx.rng.randrange(10**9))} for _ in range(1000)]
        frames.append(
            encode_frame(OP_TEXT, json.dumps({"action": "watchGames", "games": games}).encode())
        )
    end = time.monotonic() + ctx.seconds
    for _ in range(500):
        live = [a for a in attackers if a.is_open]
        if not live or time.monotonic() > end:
            break
        for attacker in live:
            if attacker.backlog < 1 << 20:
                attacker.send_raw(ctx.rng.choice(frames))
        await asyncio.sleep(0.002)
    return attackers


async def ping_flood(ctx: AttackContext) -> list[Attacker]:
    """Sockets that never subscribe and never read, sending 125-byte pings."""
    attackers = await _open_many(ctx, ctx.count, reading=False, rcvbuf=4096)
    await _flood(attackers, encode_frame(OP_PING, b"p" * 125), 200_000, ctx.seconds)
    return attackers


async def slow_readers(ctx: AttackContext) -> list[Attacker]:
    """Legacy subscribers (every game event) that never read: the outbox must close them."""
    attackers = await _open_many(ctx, ctx.count, reading=False, rcvbuf=4096)
    for index, attacker in enumerate(attackers):
        _subscribe(attacker, ctx, f"atk-slow-{index}")
    await asyncio.sleep(ctx.seconds)
    return attackers


async def tabs(ctx: AttackContext) -> list[Attacker]:
    """One account opening ``count`` sockets: the per-user cap admits the first ones."""
    attackers = await _open_many(ctx, ctx.count)
    for attacker in attackers:
        _subscribe(attacker, ctx, "atk-tabs", watchVersion=1, games=[])
        await asyncio.sleep(0.005)
    await asyncio.sleep(min(2.0, ctx.seconds))
    return attackers


async def parked(ctx: AttackContext) -> list[Attacker]:
    """Sockets that upgrade, answer pings and never subscribe."""
    attackers = await _open_many(ctx, ctx.count)
    await asyncio.sleep(ctx.seconds)
    return attackers


async def odd_game_ids(ctx: AttackContext) -> list[Attacker]:
    """Watch and publish game refs whose meta holds '#', which would collide with others'."""
    attackers = await _open_many(ctx, ctx.count)
    meta, game_id = ctx.games[0]
    for index, attacker in enumerate(attackers):
        # ("loadtest#g0", "x") and ("loadtest", "g0#x") would share "loadtest#g0#x"
        _subscribe(attacker, ctx, f"atk-odd-{index}", watchVersion=1, games=[])
        attacker.send_json(
            {"action": "watchGames", "games": [{"meta": f"{meta}#{game_id}", "id": "x"}]}
        )
    statuses = [await post(ctx, {"verb": "game", "payload": {"meta": "a#b", "id": "c"}})]
    ctx.notes["odd_publish_statuses"] = statuses
    await asyncio.sleep(1.0)
    for attacker in attackers:  # refused with an error frame; the socket stays: leave
        attacker.abort()
    return attackers


async def post(ctx: AttackContext, body: dict[str, Any]) -> int:
    return await split_post(ctx, json.dumps(body).encode(), chunked=False, pause=0.0)


async def split_post(ctx: AttackContext, body: bytes, *, chunked: bool, pause: float) -> int:
    """POST /publish written in two halves ``pause`` seconds apart; the status."""
    reader, writer = await asyncio.open_connection(*ctx.http)
    try:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
        writer.write(
            (
                f"POST /publish HTTP/1.1\r\nHost: {ctx.http[0]}:{ctx.http[1]}\r\n"
                f"Authorization: Bearer {ctx.publish_secret}\r\n"
                f"Content-Type: application/json\r\n{framing}\r\nConnection: close\r\n\r\n"
            ).encode()
        )
        half = len(body) // 2
        parts = [body[:half], body[half:]]
        if chunked:
            parts = [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts]
            parts[-1] += b"0\r\n\r\n"
        for index, part in enumerate(parts):
            if index:
                await writer.drain()
                await asyncio.sleep(pause)
            writer.write(part)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
        return int(line.split()[1])
    finally:
        writer.close()


ATTACKS: list[Attack] = [
    Attack(
        "junk_flood", "20,000 junk frames per socket, no login", ("close 1008",), 10, junk_flood
    ),
    Attack("sync_flood", "20,000 syncPresence per socket", ("close 1008",), 10, sync_flood),
    Attack("watch_churn", "watchGames of 1,000 games in a loop", ("close 1008",), 10, watch_churn),
    Attack(
        "ping_flood",
        "125-byte pings, never reading",
        ("close 1008", "close 4008", "dropped"),  # credits or outbox, whichever runs out first
        10,
        ping_flood,
    ),
    Attack(
        "slow_readers",
        "legacy subscribers that never read",
        ("close 4008", "dropped"),
        10,
        slow_readers,
        seconds=8.0,
    ),
    Attack("tabs", "40 sockets of one user", ("close 4509",), 40, tabs, open_allowed=20),
    Attack(
        "parked",
        "upgrade, never subscribe",
        ("close 4408",),
        300,
        parked,
        seconds=1.0,
        grace=12.0,  # --subscribe-timeout (10 s) plus a margin
    ),
    Attack("odd_game_ids", "meta with '#' in watch and publish", ("refused",), 10, odd_game_ids),
]
