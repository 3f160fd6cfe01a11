"""A fleet of Python-SDK clients (``apclient``) in one process, for the ``sdk`` scenario.

The parent sends the fleet its clients; the fleet starts them at a steady pace and
reports how many are connected, twice a second. Each client counts what its
*handlers* see: every ``game`` and ``notification`` event by (stream, epoch,
offset), every resync, and every outage, from the first ``disconnected`` to the
next ``connected`` (the subscribe acknowledged: recovery answered). At the end the
parent sends what was accepted for publishing, and the fleet answers with the
missed, duplicated and unexpected events it counted, and the outage durations.

Two one-way pipes: the fleet reads commands in a thread and writes reports from
its event loop, so neither direction waits for the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from apclient import Event, RealtimeClient, ResyncInfo
from loadtest.harness.worker import mint_token
from protocol.messages import game_key
from protocol.streams import game_stream, user_stream

STATUS_SECONDS = 0.5
LAG_SECONDS = 0.05


@dataclass(frozen=True)
class ClientPlan:
    user_id: str
    games: tuple[tuple[str, str], ...]
    urls: tuple[str, ...]

    @property
    def streams(self) -> list[str]:
        return [user_stream(self.user_id)] + [game_stream(game_key(m, g)) for m, g in self.games]


@dataclass(frozen=True)
class FleetSpec:
    index: int
    plans: tuple[ClientPlan, ...]
    jwt_secret: str
    start_rate: float
    """Clients started per second."""
    lifetime: float
    """Seconds after which the fleet exits whatever happens."""


@dataclass
class Watcher:
    """What one client's handlers saw."""

    plan: ClientPlan
    seen: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    resyncs: Counter[str] = field(default_factory=Counter)
    outages: list[Outage] = field(default_factory=list)
    closed_at: float | None = None
    closed_code = 0
    failures: int = 0  # attempts of this outage that failed after its first close
    waited: float = 0.0  # the SDK's own planned waits in this outage
    close_codes: Counter[int] = field(default_factory=Counter)
    failed_attempts: Counter[str] = field(default_factory=Counter)  # by reason
    connects: int = 0
    connected: bool = False

    def event(self, event: Event) -> None:
        assert event.stream is not None and event.epoch is not None and event.offset is not None
        self.seen[(event.stream, event.epoch, event.offset)] += 1

    def resync(self, _stream: str, info: ResyncInfo) -> None:
        self.resyncs[info.reason] += 1

    def disconnected(self, info: Any) -> None:
        self.connected = False
        self.close_codes[info.code] += 1
        if self.closed_at is None:
            self.closed_at = time.monotonic()  # the first close of this outage
            self.closed_code = info.code
            self.failures, self.waited = 0, 0.0
        else:
            self.failures += 1
            self.failed_attempts[_reason(info.reason)] += 1
        self.waited += info.retry_in or 0.0

    def on_connected(self) -> None:
        self.connects += 1
        self.connected = True
        if self.closed_at is not None:
            took = time.monotonic() - self.closed_at
            self.outages.append((self.closed_code, took, self.failures, self.waited))
            self.closed_at = None


Outage = tuple[int, float, int, float]
"""(first close code, seconds to the next acknowledged subscribe, failed attempts
meanwhile, seconds of them the SDK itself planned to wait)."""


def _reason(reason: str) -> str:
    """A failed attempt's reason without its details (addresses, errno texts)."""
    return reason.split(":", 1)[0] if reason.startswith("cannot connect") else reason


def fleet_main(
    spec: FleetSpec,
    commands: multiprocessing.connection.Connection,
    reports: multiprocessing.connection.Connection,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    # A session of its own, as the nodes have (servers.py): with autogroup scheduling
    # (Linux's default on desktops and here) the CPU is shared per session, so
    # fleets left in the parent's session share one slice between all of them,
    # and their clients' recovery times measure that slice, not the SDK.
    with contextlib.suppress(OSError):
        os.setsid()
    logging.basicConfig(level=logging.ERROR)  # the SDK's warnings would flood the console
    try:
        import uvloop

        uvloop.run(_fleet(spec, commands, reports))
    except ImportError:
        asyncio.run(_fleet(spec, commands, reports))


async def _fleet(
    spec: FleetSpec,
    commands: multiprocessing.connection.Connection,
    reports: multiprocessing.connection.Connection,
) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def read_commands() -> None:
        while True:
            try:
                message = commands.recv()
            except (EOFError, OSError):
                message = {"op": "stop"}
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message["op"] == "stop":
                return

    threading.Thread(target=read_commands, daemon=True).start()
    loop.call_later(spec.lifetime, os._exit, 3)  # a parent that vanished leaves no orphan
    watchers = [Watcher(plan) for plan in spec.plans]
    clients: list[RealtimeClient] = []

    async def start_all() -> None:
        for number, watcher in enumerate(watchers):
            due = number / spec.start_rate
            started = loop.time() - begun
            if due > started:
                await asyncio.sleep(due - started)
            token = mint_token(spec.jwt_secret, watcher.plan.user_id)
            client = RealtimeClient(
                list(watcher.plan.urls),
                get_token=lambda t=token: t,
                games=watcher.plan.games,
                wants_presence=False,  # the figures are events and recovery, not presence
            )
            client.on("game", watcher.event)
            client.on("notification", watcher.event)
            client.on("resync", watcher.resync)
            client.on("disconnected", watcher.disconnected)
            client.on("connected", watcher.on_connected)
            client.start()
            clients.append(client)

    async def status() -> None:
        while True:
            reports.send(
                {
                    "op": "status",
                    "index": spec.index,
                    "started": len(clients),
                    "connected": sum(w.connected for w in watchers),
                    "outages_open": sum(w.closed_at is not None for w in watchers),
                }
            )
            await asyncio.sleep(STATUS_SECONDS)

    lags: list[float] = []

    async def lag() -> None:
        """How late this process's loop runs a timer: a starved generator shows here."""
        while True:
            due = loop.time() + LAG_SECONDS
            await asyncio.sleep(LAG_SECONDS)
            lags.append(loop.time() - due)

    begun = loop.time()
    starter = asyncio.create_task(start_all())
    reporter = asyncio.create_task(status())
    lagger = asyncio.create_task(lag())
    try:
        while True:
            message = await inbox.get()
            if message["op"] == "finish":
                reports.send(_result(spec.index, watchers, message["accepted"], lags))
            elif message["op"] == "stop":
                break
    finally:
        for task in (starter, reporter, lagger):
            task.cancel()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        with contextlib.suppress(OSError):
            reports.send({"op": "stopped", "index": spec.index})


def _result(
    index: int,
    watchers: list[Watcher],
    accepted: dict[str, list[tuple[str, int]]],
    lags: list[float],
) -> dict[str, Any]:
    missed = duplicated = unexpected = expected_total = 0
    resyncs: Counter[str] = Counter()
    codes: Counter[int] = Counter()
    outages: list[Outage] = []
    failed: Counter[str] = Counter()
    for watcher in watchers:
        expected = {
            (stream, epoch, offset)
            for stream in watcher.plan.streams
            for epoch, offset in accepted.get(stream, ())
        }
        expected_total += len(expected)
        seen = watcher.seen
        missed += len(expected - seen.keys())
        unexpected += len(seen.keys() - expected)
        duplicated += sum(count - 1 for count in seen.values() if count > 1)
        resyncs.update(watcher.resyncs)
        codes.update(watcher.close_codes)
        outages += watcher.outages
        failed.update(watcher.failed_attempts)
    return {
        "op": "result",
        "index": index,
        "clients": len(watchers),
        "expected": expected_total,
        "missed": missed,
        "duplicated": duplicated,
        "unexpected": unexpected,
        "resyncs": dict(resyncs),
        "close_codes": {str(code): count for code, count in codes.items()},
        "outages_s": outages,
        "failed_attempts": dict(failed),
        "loop_lag_s": sorted(lags),
        "open_outages": sum(w.closed_at is not None for w in watchers),
        "connects": sum(w.connects for w in watchers),
    }
