"""Tools for the SDK tests: a recorder of what the application sees, a TCP proxy that
delays or silences a connection, and a tiny WebSocket server that closes on cue."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve

from apclient import (
    Disconnected,
    Event,
    RealtimeClient,
    RecoveryInfo,
    ResyncInfo,
    ServerError,
)
from tests.services import HOST
from tests.waiting import eventually

STREAM_VERBS = ("game", "chat", "yourTurn", "notification", "challenge", "gameStart", "gameEnd")


@dataclass
class Recorder:
    """Everything the handlers of one client saw, in the order they saw it."""

    events: list[Event] = field(default_factory=list)
    recovered: list[RecoveryInfo] = field(default_factory=list)
    resyncs: list[ResyncInfo] = field(default_factory=list)
    disconnects: list[Disconnected] = field(default_factory=list)
    errors: list[ServerError] = field(default_factory=list)
    states: list[str] = field(default_factory=list)
    connects: int = 0

    def attach(self, client: RealtimeClient) -> Recorder:
        for verb in (*STREAM_VERBS, "pendingTurns", "test"):
            client.on(verb, self.events.append)
        client.on("recovered", self.recovered.append)
        client.on("resync", lambda _stream, info: self.resyncs.append(info))
        client.on("disconnected", self.disconnects.append)
        client.on("error", self.errors.append)
        client.on("state", self.states.append)
        client.on("connected", self._connected)
        return self

    def _connected(self) -> None:
        self.connects += 1

    def payloads(self, key: str = "n") -> list[Any]:
        """``payload[key]`` of every delivered payload (a coalesced call counts each)."""
        return [p[key] for e in self.events for p in e.batch if isinstance(p, dict) and key in p]

    async def until(self, check: Callable[[], bool], what: str, within: float = 15.0) -> None:
        await eventually(check, within, what)


async def publish_games(server: Any, game: tuple[str, str], numbers: range) -> None:
    """``POST /publish`` of one ``game`` event per number, payload ``n``."""
    meta, game_id = game
    for n in numbers:
        status, reply = await server.publish(
            {"verb": "game", "payload": {"meta": meta, "id": game_id, "n": n}}
        )
        assert status == 202, reply


class TcpProxy:
    """A TCP relay in front of a server, to make a real network misbehave.

    - ``hold(seconds)``: on the next connection, bytes from the client after its
      upgrade request wait ``seconds`` (a slow uplink: the subscribe arrives late);
    - ``silence()``: the connections open now pass nothing more either way and stay
      open (a NAT that forgot them); new connections work.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.connections = 0
        self._hold_next = 0.0
        self._live: list[asyncio.Event] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"ws://{HOST}:{self.port}/"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def hold(self, seconds: float) -> None:
        self._hold_next = seconds

    def silence(self) -> None:
        for silenced in self._live:
            silenced.set()
        self._live = []

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        hold, self._hold_next = self._hold_next, 0.0
        up_reader, up_writer = await asyncio.open_connection(HOST, self.upstream_port)
        silenced = asyncio.Event()
        self._live.append(silenced)
        tasks = [
            asyncio.create_task(self._pump(reader, up_writer, silenced, hold)),
            asyncio.create_task(self._pump(up_reader, writer, silenced, 0.0)),
        ]
        self._tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
                self._tasks.discard(task)
            for out in (writer, up_writer):
                out.close()

    @staticmethod
    async def _pump(
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        silenced: asyncio.Event,
        hold: float,
    ) -> None:
        upgraded = hold <= 0
        seen = b""
        while data := await source.read(65536):
            if silenced.is_set():
                continue  # swallowed: the peer hears nothing, and no FIN either
            if not upgraded:
                seen += data
                end = seen.find(b"\r\n\r\n")
                if end >= 0:
                    upgraded = True
                    head, rest = seen[: end + 4], seen[end + 4 :]
                    sink.write(head)
                    await sink.drain()
                    await asyncio.sleep(hold)
                    if rest:
                        sink.write(rest)
                continue
            sink.write(data)
            await sink.drain()
        # the source closed: hold the sink open while silenced (a dead peer sends no FIN)
        if silenced.is_set():
            await asyncio.Event().wait()


@dataclass
class ScriptedServer:
    """A WebSocket server that acknowledges subscribes, then does what ``script`` says
    with each connection: ``script(n, ws)`` for the n-th connection (from 0)."""

    script: Callable[[int, ServerConnection], Any]
    subscribes: list[dict[str, Any]] = field(default_factory=list)
    connections: int = 0
    server: Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"ws://{HOST}:{port}/"

    async def start(self) -> ScriptedServer:
        self.server = await serve(self._handle, HOST, 0)
        return self

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            async with asyncio.timeout(10):
                await self.server.wait_closed()

    async def _handle(self, ws: ServerConnection) -> None:
        number = self.connections
        self.connections += 1
        with contextlib.suppress(Exception):
            await self.script(number, ws)


async def read_subscribe(server: ScriptedServer, ws: ServerConnection) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(await ws.recv())
    server.subscribes.append(message)
    return message


async def ack(ws: ServerConnection, message: dict[str, Any], heartbeat: int | None = None) -> None:
    payload: dict[str, Any] = {"ackId": message["ackId"], "action": message["action"]}
    if heartbeat is not None:
        payload["heartbeatSeconds"] = heartbeat
    await ws.send(json.dumps({"verb": "ack", "payload": payload}))
