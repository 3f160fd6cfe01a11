"""The load generator's connect loop: one live connection per simulated client, honest counts.

Real sockets on 127.0.0.1 under uvloop (as the workers run), against a tiny
server that answers every upgrade at once: the harness, not our server, is
under test here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

from loadtest.clients.sim import ClientSpec, SimClient, accept_key
from loadtest.harness.worker import Slot, Worker, WorkerConfig

SPEC = ClientSpec(user_id="u1", games=(("chess", "g1"),), streams=True)


async def _upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer the upgrade with a 101 at once, then hold the socket until the peer goes."""
    head = await reader.readuntil(b"\r\n\r\n")
    key = next(
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"sec-websocket-key:")
    )
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept_key(key) + b"\r\n\r\n"
    )
    await reader.read()  # the client's frames, until it closes
    writer.close()


class UpgradeServer:
    """The upgrade server on its own thread and loop: it answers while the client stalls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(_upgrade, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.run_until_complete(server.wait_closed())
        self.loop.close()

    def __enter__(self) -> int:
        self.thread.start()
        self.ready.wait(10)
        return self.port

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _run(body: Callable[[Worker, int], Awaitable[None]]) -> None:
    async def main(port: int) -> None:
        parent, child = multiprocessing.Pipe()
        worker = Worker(WorkerConfig(index=0, jwt_secret="s", lifetime=30.0), child)
        try:
            await body(worker, port)
        finally:
            worker._abort_all()
            parent.close()
            child.close()

    with UpgradeServer() as port:
        uvloop.run(main(port))


def _open(client: SimClient | None) -> bool:
    return client is not None and client.is_open


async def _until(check: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


class StalledClient(SimClient):
    """A client whose process stalls right after connect: the 101 arrives, and the
    connect timeout passes, before the connecting task runs again."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        time.sleep(0.3)


def test_a_connect_timed_out_after_connection_made_leaves_no_open_client() -> None:
    # uvloop's create_connection, cancelled once connection_made has run, closes
    # the socket and never calls connection_lost; the client read its 101 in
    # between. It must not stay open in the counts, nor keep its timers.
    async def body(worker: Worker, port: int) -> None:
        worker.connect_timeout = 0.1
        client = StalledClient(SPEC, "t", "127.0.0.1", port, worker.tally)
        assert not await worker._connect(client, "127.0.0.1", port)
        await asyncio.sleep(0.1)
        assert not client.is_open
        assert worker.tally.connected == 0
        assert not client._timers
        assert worker.tally.connect_failures == 1
        # the socket was up: a handshake timeout, not a TCP one
        assert worker.tally.connect_timeouts_handshake == 1

    _run(body)


def test_two_connect_loops_for_one_client_leave_one_live_connection() -> None:
    async def body(worker: Worker, port: int) -> None:
        slot = Slot(SPEC, "t", ("127.0.0.1", port))
        worker.slots.append(slot)
        worker.stopping = False
        # e.g. a reconnect after a drop racing the loop still connecting
        await asyncio.gather(worker._open(slot), worker._open(slot))
        await asyncio.sleep(0.1)
        assert slot.client is not None and slot.client.is_open
        assert worker.tally.connected == 1
        assert not slot.looping

    _run(body)


def test_a_new_attempt_ends_the_slots_previous_connection() -> None:
    async def body(worker: Worker, port: int) -> None:
        slot = Slot(SPEC, "t", ("127.0.0.1", port))
        worker.slots.append(slot)
        first = await worker._attempt(slot)
        second = await worker._attempt(slot)
        assert first is not None and second is not None
        await asyncio.sleep(0.1)
        assert not first.is_open and second.is_open
        assert worker.tally.connected == 1
        assert worker.tally.dropped == 0  # ended by us: not a drop
        # an attempt we abandoned ourselves is not a failed connect
        assert worker.tally.connect_failures == 0

    _run(body)


def test_a_dropped_client_reconnects_once_and_its_backoff_restarts_on_open() -> None:
    async def body(worker: Worker, port: int) -> None:
        slot = Slot(SPEC, "t", ("127.0.0.1", port))
        worker.slots.append(slot)
        worker.stopping = False
        assert await worker._open(slot)
        first = slot.client
        assert first is not None and first.transport is not None
        # the server drops it (as a keepalive timeout would): one reopen, after a backoff
        first.transport.abort()
        await _until(lambda: slot.client is not first and _open(slot.client), within=10.0)
        assert worker.tally.reconnects == 1 and worker.tally.connected == 1
        assert slot.attempts == 0

    _run(body)
