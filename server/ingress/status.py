"""The operator's page (``GET /``) and the JSON it polls (``GET /status``).

Both live on the internal listener. The page is one self-contained file
(no CDN, no build step) that fetches ``/status`` every two seconds; the JSON
reads the same numbers ``/metrics`` shows, plus the cluster's members and a
few minutes of history for the page's chart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sized
from importlib import resources
from typing import Any, Protocol

from protocol.http11 import Request
from server.config import Settings
from server.ingress.routes import Reply, Routes
from server.runtime.metrics import Registry

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 2.0
HISTORY_SAMPLES = 300  # ten minutes at one sample every two seconds
PAGE = resources.files("server.ingress").joinpath("status.html").read_bytes()


class StatusSource(Protocol):
    """What the page needs of the hub (``server.node.Node`` is one)."""

    @property
    def sessions(self) -> Sized: ...

    @property
    def metrics(self) -> Registry: ...

    async def status(self) -> dict[str, Any]: ...


class History:
    """Connections and bus events per second, one sample per ``SAMPLE_SECONDS``."""

    def __init__(self, node: StatusSource) -> None:
        self.node = node
        self.samples: deque[tuple[float, int, float]] = deque(maxlen=HISTORY_SAMPLES)
        self._last: tuple[float, float] | None = None

    def sample(self) -> None:
        now = time.time()
        events = self.node.metrics.value("ap_bus_messages_total")
        rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = (events - self._last[1]) / (now - self._last[0])
        self._last = (now, events)
        self.samples.append((now, len(self.node.sessions), rate))

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_SECONDS)

    def as_json(self) -> dict[str, Any]:
        return {
            "interval_s": SAMPLE_SECONDS,
            "t": [round(t, 3) for t, _, _ in self.samples],
            "connections": [c for _, c, _ in self.samples],
            "events_per_s": [round(r, 2) for _, _, r in self.samples],
        }


async def status(node: StatusSource, settings: Settings, history: History) -> dict[str, Any]:
    """The hub's own figures, with its settings, its node's counters and the chart."""
    own = await node.status()
    metrics = node.metrics
    return {
        "node": own["node"],
        "mode": "cluster" if settings.clustered else "embedded",
        "time": time.time(),
        "ready": own["ready"],
        "draining": own["draining"],
        "connections": own["connections"],
        "users": own["users"],
        "watched_games": own["watched_games"],
        "presence": own["presence"],
        "bus": {
            "kind": "redis" if settings.clustered else "memory",
            "connected": own["bus_connected"],
            "reconnects": metrics.get("ap_bus_reconnects_total"),
        },
        "store": {
            "kind": settings.store,
            "table": settings.table if settings.store == "dynamodb" else None,
            "write_backlog": metrics.value("ap_store_write_backlog"),
            "write_retries": metrics.value("ap_store_write_retries_total"),
        },
        "closes": {
            "slow_consumer": metrics.value("ap_slow_consumers_total"),
            "rate_limited": metrics.value("ap_flood_closes_total"),
        },
        "events": {
            "published": metrics.value("ap_events_published_total"),
            "received": metrics.value("ap_bus_messages_total"),
            "frames_sent": metrics.value("ap_frames_sent_total"),
        },
        "nodes": own["nodes"],
        "history": history.as_json(),
    }


def add_routes(routes: Routes, node: StatusSource, settings: Settings) -> History:
    """``GET /`` and ``GET /status``; the history the listener samples while it runs."""
    history = History(node)

    async def page(request: Request) -> Reply:
        return Reply(200, PAGE, "text/html; charset=utf-8")

    async def status_json(request: Request) -> Reply:
        return Reply.json(200, await status(node, settings, history))

    routes.add("GET", "/", page)
    routes.add("GET", "/status", status_json)
    return history
