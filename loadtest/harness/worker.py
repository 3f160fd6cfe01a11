"""Generator worker processes: each runs uvloop with many simulated clients.

The parent talks to each worker over a pipe. Commands are small dicts with an
``op``; a worker answers each command that expects an answer with a dict of
the same ``op``, and sends a ``tick`` with its cumulative counters every
``TICK`` seconds, which feeds the progress bar and the time series.

A worker exits when told, when its pipe closes, or when its lifetime runs out,
so a crashed parent never leaves it behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jwt

from loadtest.clients.sim import ClientSpec, HandshakeError, SimClient, StreamBook, Tally
from loadtest.harness.procstat import raise_fd_limit

TICK = 0.25
BACKOFF_START = 2.0  # the browser's reconnect backoff
BACKOFF_MAX = 30.0
MAX_RECONNECTS = 8

Message = dict[str, Any]
Endpoint = tuple[str, int]


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    index: int
    jwt_secret: str
    lifetime: float
    """Seconds after which the worker exits whatever happens."""


def _endpoint(value: Sequence[Any]) -> Endpoint:
    """An endpoint from the wire (a pickled tuple or list)."""
    return (str(value[0]), int(value[1]))


def mint_token(secret: str, user_id: str) -> str:
    now = int(time.time())
    return jwt.encode({"sub": user_id, "iat": now, "exp": now + 86400}, secret, algorithm="HS256")


class Slot:
    """One simulated user's place: its spec, endpoint and current connection.

    A slot has at most one connect loop (``loop_id`` names the newest; an older
    one stops at its next step) and at most one live connection: each attempt
    ends the slot's previous client first. Two connections sharing one
    ``StreamBook`` would count each other's events as duplicates.
    """

    __slots__ = ("attempts", "book", "client", "endpoint", "loop_id", "looping", "spec", "token")

    def __init__(self, spec: ClientSpec, token: str, endpoint: Endpoint) -> None:
        self.spec = spec
        self.token = token
        self.endpoint = endpoint
        self.client: SimClient | None = None
        self.attempts = 0
        """Failed attempts since the last open (the browser's backoff restarts on open)."""
        self.loop_id = 0
        self.looping = False
        # the stream positions outlive each connection, as a browser's would
        self.book = StreamBook() if spec.streams else None


class Worker:
    def __init__(self, config: WorkerConfig, conn: multiprocessing.connection.Connection) -> None:
        self.config = config
        self.conn = conn
        self.tally = Tally()
        self.slots: list[Slot] = []
        self.slot_of: dict[SimClient, Slot] = {}
        self.stopping = False
        self.connect_timeout = 15.0
        self.reconnect = True
        self.tasks: set[asyncio.Task[Any]] = set()
        self.churn_actions: list[tuple[str, str, int]] = []
        self.done: asyncio.Future[None] | None = None

    # --- plumbing -----------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        loop.add_reader(self.conn.fileno(), self._readable)
        # uvloop makes a watched fd non-blocking; recv() must block for a whole message
        os.set_blocking(self.conn.fileno(), True)
        ticker = asyncio.create_task(self._ticks())
        try:
            await asyncio.wait_for(self.done, timeout=self.config.lifetime)
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(self.conn.fileno())
            ticker.cancel()
            self._abort_all()

    def _readable(self) -> None:
        try:
            message: Message = self.conn.recv()
        except (EOFError, OSError):
            self._finish()
            return
        self._spawn(self._handle(message))

    def _finish(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def send(self, message: Message) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            self._finish()

    async def _ticks(self) -> None:
        while True:
            self.send({"op": "tick", "t": time.time_ns(), "c": self.tally.counters()})
            await asyncio.sleep(TICK)

    async def _handle(self, message: Message) -> None:
        op = message["op"]
        try:
            if op == "connect":
                await self.connect(
                    message["specs"],
                    message["endpoints"],
                    at_ns=message.get("at_ns"),
                    concurrency=message.get("concurrency"),
                    limit=message.get("timeout", 15.0),
                )
                # The clients live for the whole measurement: keep the cyclic
                # collector from scanning them, or its pauses (tens of ms per
                # thousand clients) would show up as server latency.
                gc.collect()
                gc.freeze()
            elif op == "churn":
                await self.churn(
                    message["endpoints"],
                    rate=message["rate"],
                    hold=message["hold"],
                    duration=message["duration"],
                    prefix=message["prefix"],
                    start_ns=message["start_ns"],
                )
            elif op == "reconnect":
                await self.reconnect_all(message["at_ns"], message.get("timeout", 15.0))
            elif op == "positions":
                self.send({"op": op, **self.positions(message["tops"])})
                return
            elif op == "verify":
                await self.verify(message["timeout"])
            elif op == "collect":
                self.send({"op": "collect", **self.collect()})
                return
            elif op == "close_all":
                await self.close_all()
            elif op == "reset":
                gc.unfreeze()
                self._abort_all()
                self.tally = Tally()
                self.slots = []
                self.slot_of = {}
                self.churn_actions = []
                self.stopping = False
            elif op == "exit":
                self._finish()
                return
            self.send({"op": op})
        except Exception as exc:  # report, never hang the parent
            self.send({"op": op, "error": f"{type(exc).__name__}: {exc}"})

    # --- clients ------------------------------------------------------------

    async def connect(
        self,
        specs: Sequence[ClientSpec],
        endpoints: Sequence[Endpoint],
        *,
        at_ns: int | None,
        concurrency: int | None,
        limit: float,
    ) -> None:
        """Connect every spec (spread over ``endpoints``), all at ``at_ns`` or ramped."""
        self.stopping = False
        self.connect_timeout = limit
        secret = self.config.jwt_secret
        slots = [
            Slot(spec, mint_token(secret, spec.user_id), _endpoint(endpoints[i % len(endpoints)]))
            for i, spec in enumerate(specs)
        ]
        self.slots.extend(slots)
        if at_ns is not None:
            await asyncio.sleep(max(0.0, (at_ns - time.time_ns()) / 1e9))
        if concurrency is None:
            await asyncio.gather(*(self._open(slot) for slot in slots))
            return
        gate = asyncio.Semaphore(concurrency)

        async def gated(slot: Slot) -> None:
            async with gate:
                await self._open(slot)

        await asyncio.gather(*(gated(slot) for slot in slots))

    async def _open(self, slot: Slot, delay: float = 0.0) -> bool:
        """The slot's connect loop: attempts with the browser's backoff until one opens.

        Starting it supersedes any older loop of the slot, which stops at its
        next step without another attempt.
        """
        slot.loop_id += 1
        mine = slot.loop_id
        slot.looping = True
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            while not self.stopping and slot.loop_id == mine:
                client = await self._attempt(slot)
                if client is not None and slot.loop_id == mine:
                    if client.is_open:
                        slot.attempts = 0
                        return True
                    # Dropped between its open and now: its on_lost saw this
                    # loop running and left the next attempt to it.
                    self.tally.reconnects += 1
                slot.attempts += 1
                if not self.reconnect or slot.attempts > MAX_RECONNECTS:
                    self.tally.gave_up += 1
                    return False
                await asyncio.sleep(self._backoff(slot.attempts))
            return False
        finally:
            if slot.loop_id == mine:
                slot.looping = False

    def _backoff(self, attempts: int) -> float:
        base: float = min(BACKOFF_MAX, BACKOFF_START * 2 ** (attempts - 1))
        return base * (0.8 + 0.4 * random.random())

    async def _attempt(self, slot: Slot) -> SimClient | None:
        """One connect attempt for the slot; the client if it opened."""
        host, port = slot.endpoint
        client = SimClient(slot.spec, slot.token, host, port, self.tally, self._lost, slot.book)
        client.started_ns = time.time_ns()
        previous = slot.client
        if previous is not None:
            self.slot_of.pop(previous, None)
            previous.abort()  # one live connection per slot, whatever came before
        slot.client = client
        self.slot_of[client] = slot
        return client if await self._connect(client, host, port) else None

    async def _connect(self, client: SimClient, host: str, port: int) -> bool:
        """Connect and complete the handshake in time; a failure is counted and aborted.

        An attempt we abandoned ourselves (the client aborted meanwhile: a
        newer attempt, ``close_all``) is not a failed connect.
        """
        try:
            async with asyncio.timeout(self.connect_timeout):
                await asyncio.get_running_loop().create_connection(lambda: client, host, port)
                await client.opened
        except (OSError, TimeoutError, HandshakeError) as exc:
            if not client.closing:
                # connection_made ran: TCP was up, whatever create_connection said
                self._count_failure(exc, client.transport is not None)
            client.abort()
            return False
        return True

    def _count_failure(self, exc: BaseException, connected: bool) -> None:
        """Every failed attempt counts, each under its cause: a 503 or a timeout is
        a failed connect as much as a refused one, for the client that sees it."""
        tally = self.tally
        tally.connect_failures += 1
        if isinstance(exc, TimeoutError) and connected:
            tally.connect_timeouts_handshake += 1
        elif isinstance(exc, TimeoutError):
            tally.connect_timeouts_tcp += 1
        elif isinstance(exc, ConnectionRefusedError):
            tally.connect_refused += 1
        elif isinstance(exc, HandshakeError) and exc.status == 503:
            tally.connect_shed += 1
        elif isinstance(exc, ConnectionError) or (
            isinstance(exc, HandshakeError) and exc.status == 0 and "closed" in str(exc)
        ):
            tally.connect_reset += 1
        else:
            tally.connect_other += 1
            if len(tally.error_samples) < 20:
                tally.error_samples.append(f"connect: {type(exc).__name__}: {exc}"[:200])

    def _lost(self, client: SimClient, code: int | None) -> None:
        if self.stopping or client.closing or not self.reconnect:
            return
        if code == 1001:
            return  # an idle timeout: the browser waits until the tab is visible again
        slot = self.slot_of.get(client)
        if slot is None or slot.client is not client or slot.looping:
            return  # not the slot's connection, or its connect loop is still running
        self.tally.reconnects += 1
        slot.attempts += 1
        self._spawn(self._open(slot, self._backoff(slot.attempts)))

    async def close_all(self) -> None:
        """Drop every connection (teardown: not measured)."""
        self.stopping = True
        self._abort_all()
        for _ in range(100):  # at most 5 s
            if self.tally.connected <= 0:
                break
            await asyncio.sleep(0.05)

    def _abort_all(self) -> None:
        self.stopping = True
        for slot in self.slots:
            if slot.client is not None:
                slot.client.abort()

    async def reconnect_all(self, at_ns: int, limit: float) -> None:
        """Open every slot again at ``at_ns``, the clients keeping what they knew.

        The slots must have been closed with ``close_all``. Stream clients
        subscribe with ``since`` their last positions: a reconnect storm.
        """
        self.connect_timeout = limit
        self.tally.first_snapshot_ns = []
        self.tally.recovered_ns = []
        for slot in self.slots:
            slot.attempts = 0
            if slot.book is not None:
                slot.book.recovered_ns = 0
        await asyncio.sleep(max(0.0, (at_ns - time.time_ns()) / 1e9))
        self.stopping = False
        await asyncio.gather(*(self._open(slot) for slot in self.slots))

    def positions(self, tops: dict[str, Any]) -> Message:
        """Compare every stream client's last positions with each stream's top.

        ``tops`` maps a stream to its last offset. ``behind`` sums how far
        connected clients are below it (events never received; a stream with
        no position at all counts whole), ``ahead`` how far above; ``epochs``
        lists each stream's epochs seen by these clients. A client with no
        open connection (it gave up, or is between attempts) proves nothing
        about the server: its streams are counted apart, in ``disconnected``
        and ``behind_disconnected``.
        """
        behind = ahead = unknown = checked = disconnected = behind_disconnected = 0
        epochs: dict[str, set[str]] = {}
        for slot in self.slots:
            if slot.book is None:
                continue
            if slot.client is None or not slot.client.is_open:
                disconnected += 1
                for meta, game_id in slot.spec.games:
                    top = tops.get(f"game:{meta}#{game_id}")
                    position = slot.book.positions.get(f"game:{meta}#{game_id}")
                    if top is not None:
                        behind_disconnected += max(0, int(top) - (position or [0, 0])[1])
                continue
            for meta, game_id in slot.spec.games:
                stream = f"game:{meta}#{game_id}"
                top = tops.get(stream)
                if top is None:
                    continue
                position = slot.book.positions.get(stream)
                checked += 1
                if position is None:
                    unknown += 1
                    behind += int(top)
                    continue
                epochs.setdefault(stream, set()).add(position[0])
                behind += max(0, int(top) - position[1])
                ahead += max(0, position[1] - int(top))
        return {
            "checked": checked,
            "behind": behind,
            "ahead": ahead,
            "unknown": unknown,
            "disconnected": disconnected,
            "behind_disconnected": behind_disconnected,
            "epochs": {stream: sorted(seen) for stream, seen in epochs.items()},
        }

    async def verify(self, limit: float) -> None:
        """Full observers ask for a snapshot and compare it with the state they built."""
        checking = [
            slot.client
            for slot in self.slots
            if slot.spec.full and slot.client is not None and slot.client.is_open
        ]
        deadline = time.monotonic() + limit
        pending = list(checking)
        while pending and time.monotonic() < deadline:
            for client in pending:
                client.verifying = True
                client.sync_presence()
            await asyncio.sleep(0.3)
            pending = [client for client in pending if client.verifying and client.is_open]

    # --- presence churn -----------------------------------------------------

    async def churn(
        self,
        endpoints: Sequence[Endpoint],
        *,
        rate: float,
        hold: float,
        duration: float,
        prefix: str,
        start_ns: int,
    ) -> None:
        """Join ``rate`` new users a second for ``duration``; each leaves after ``hold``.

        Every user is new, and stays longer than the debounce window, so each
        join and each leave must appear in some delta. The time of each action
        (subscribe written, close frame written) is recorded for the parent.
        """
        self.stopping = False
        secret = self.config.jwt_secret
        count = max(1, math.floor(rate * duration))
        start = start_ns / 1e9
        joined: list[tuple[float, SimClient]] = []
        pending: set[asyncio.Task[None]] = set()
        next_join = 0
        deadline = start + duration + hold + self.connect_timeout + 5

        async def join(index: int) -> None:
            user = f"{prefix}{index}"
            spec = ClientSpec(user_id=user, quiet=True)
            host, port = endpoints[index % len(endpoints)]
            client = SimClient(spec, mint_token(secret, user), host, port, self.tally)
            if not await self._connect(client, host, port):
                return
            self.churn_actions.append((user, "join", client.action_ns))
            joined.append((time.time() + hold, client))

        while time.time() < deadline:
            now = time.time()
            while next_join < count and start + next_join / rate <= now:
                task = asyncio.create_task(join(next_join))
                pending.add(task)
                task.add_done_callback(pending.discard)
                next_join += 1
            while joined and joined[0][0] <= now:
                _, client = joined.pop(0)
                client.close(1001)  # the tab closes: "going away"
                self.churn_actions.append((client.spec.user_id, "leave", time.time_ns()))
            if next_join >= count and not pending and not joined:
                break
            await asyncio.sleep(0.005)

    # --- results ------------------------------------------------------------

    def collect(self) -> Message:
        tally = self.tally
        return {
            "counters": tally.counters(),
            "latency": {phase: h.to_wire() for phase, h in tally.latency.items()},
            "seqs": {
                seq: (record.joins, record.leaves, record.arrivals)
                for seq, record in tally.seqs.items()
            },
            "first_snapshot_ns": tally.first_snapshot_ns,
            "recovered_ns": tally.recovered_ns,
            "clients_recovered_ns": [
                slot.book.recovered_ns
                for slot in self.slots
                if slot.book is not None and slot.book.recovered_ns
            ],
            "started_ns": [
                slot.client.started_ns for slot in self.slots if slot.client is not None
            ],
            "churn_actions": self.churn_actions,
            "error_samples": tally.error_samples,
            "pid": os.getpid(),
        }


def worker_main(config: WorkerConfig, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a worker process."""
    raise_fd_limit()
    worker = Worker(config, conn)
    runner: Callable[[Any], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(worker.run())
