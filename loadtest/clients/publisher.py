"""Publish game events over ``POST /publish``, closed-loop or at a fixed rate.

Each event's payload carries ``ts`` (nanoseconds since the epoch) and ``ph``
(the phase it belongs to); servers forward extra payload fields unchanged,
so receivers compute latency and attribute every delivery to its phase.

At a fixed rate the timestamp is the *scheduled* send time, not the moment
a sender got round to it: if the server (or the publisher) falls behind,
the queueing shows up in the latency instead of being hidden
(no coordinated omission).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.clients.http import HttpConnection

Game = tuple[str, str]

# POST /publish answers with the event's assigned position (issue 8)
_OFFSET = re.compile(rb'"offset":(\d+)')


@dataclass
class PublishStats:
    """What one publishing phase did."""

    phase: int
    sent: int = 0
    accepted: int = 0
    failed: int = 0
    expected_deliveries: int = 0
    late: int = 0
    """Fixed rate only: events sent more than 10 ms after their scheduled time."""
    started: float = 0.0
    ended: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return max(1e-9, self.ended - self.started)


class Publisher:
    """Keep-alive connections to one or more servers' internal HTTP listeners."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        secret: str,
        games: Sequence[Game],
        watchers: Sequence[int],
        connections: int,
        seed: int = 1,
    ) -> None:
        headers = {"Authorization": f"Bearer {secret}"}
        self.connections = [
            HttpConnection(*endpoints[i % len(endpoints)], headers=headers)
            for i in range(connections)
        ]
        self.games = list(games)
        self.watchers = list(watchers)
        self.random = random.Random(seed)
        self.pad = ""  # extra payload bytes per event (abuse: fills slow readers' outboxes)
        self.accepted_by_game = [0] * len(self.games)
        self.top_offset = [0] * len(self.games)
        """The highest offset the server's replies assigned in each game's stream."""

    def _body(self, game: int, ts: int, phase: int) -> bytes:
        meta, game_id = self.games[game]
        pad = f',"pad":"{self.pad}"' if self.pad else ""
        return (
            f'{{"verb":"game","payload":{{"meta":"{meta}","id":"{game_id}",'
            f'"ts":{ts},"ph":{phase}{pad}}}}}'
        ).encode()

    async def _post(
        self, connection: HttpConnection, game: int, ts: int, stats: PublishStats
    ) -> None:
        stats.sent += 1
        try:
            status, body = await connection.request(
                "POST", "/publish", self._body(game, ts, stats.phase)
            )
        except Exception:
            stats.failed += 1
            return
        stats.statuses[status] = stats.statuses.get(status, 0) + 1
        if 200 <= status < 300:
            stats.accepted += 1
            stats.expected_deliveries += self.watchers[game]
            self.accepted_by_game[game] += 1
            match = _OFFSET.search(body)
            if match is not None and int(match[1]) > self.top_offset[game]:
                self.top_offset[game] = int(match[1])
        else:
            stats.failed += 1

    async def closed_loop(self, phase: int, duration: float) -> PublishStats:
        """Every connection posts back to back for ``duration``: the saturating rate."""
        stats = PublishStats(phase=phase, started=time.time())
        end = stats.started + duration
        pick = self.random.randrange
        count = len(self.games)

        async def sender(connection: HttpConnection) -> None:
            while time.time() < end:
                await self._post(connection, pick(count), time.time_ns(), stats)

        await asyncio.gather(*(sender(c) for c in self.connections))
        stats.ended = time.time()
        return stats

    async def fixed_rate(self, phase: int, rate: float, duration: float) -> PublishStats:
        """Post ``rate`` events a second for ``duration``, stamped with their scheduled time."""
        stats = PublishStats(phase=phase, started=time.time())
        total = max(1, int(rate * duration))
        start_ns = time.time_ns()
        queue: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        pick = self.random.randrange
        count = len(self.games)

        async def sender(connection: HttpConnection) -> None:
            while True:
                job = await queue.get()
                if job is None:
                    return
                game, ts = job
                if time.time_ns() - ts > 10_000_000:
                    stats.late += 1
                await self._post(connection, game, ts, stats)

        senders = [asyncio.create_task(sender(c)) for c in self.connections]
        scheduled = 0
        # bounded: stops scheduling at ``total`` or after twice the duration
        hard_end = time.time() + duration * 2 + 5
        while scheduled < total and time.time() < hard_end:
            due = min(total, int((time.time_ns() - start_ns) * rate / 1e9) + 1)
            while scheduled < due:
                queue.put_nowait((pick(count), start_ns + int(scheduled * 1e9 / rate)))
                scheduled += 1
            await asyncio.sleep(0.001)
        stats.ended = time.time()  # the publishing window; stragglers may still be in flight
        for _ in senders:
            queue.put_nowait(None)
        await asyncio.wait(senders, timeout=duration + 30)
        for task in senders:
            task.cancel()
        return stats

    async def each_game(self, phase: int, count: int) -> PublishStats:
        """Publish ``count`` events to every game, as fast as the server takes them."""
        stats = PublishStats(phase=phase, started=time.time())
        jobs = iter([game for _ in range(count) for game in range(len(self.games))])

        async def sender(connection: HttpConnection) -> None:
            for game in jobs:
                await self._post(connection, game, time.time_ns(), stats)

        await asyncio.gather(*(sender(c) for c in self.connections))
        stats.ended = time.time()
        return stats

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
