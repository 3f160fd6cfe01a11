"""The internal HTTP listener: publish, health, readiness, metrics, the operator's page.

It listens apart from the public WebSocket port so that a load balancer
exposes only the latter; the backend and operators reach this one.

Every published event is named before its first attempt: by the publisher's
``Idempotency-Key`` header (a retry of the same request, even after a 503 or
a lost answer, is appended once and answered with the first positions), or
else by a name made here, which every internal retry reuses.

``POST /publish`` comes once per game event, so what it costs is part of
every event's fan-out: the listener is ``server.ingress.http_server`` over
``protocol.http11``, not a framework whose request objects cost more than
the event they carry.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Protocol

from protocol.errors import ProtocolError
from protocol.http11 import Request
from protocol.messages import AdminTest, Broadcast, Position
from protocol.parse import parse_broadcast
from server.bus.streams import new_event_id
from server.config import Settings
from server.ingress import status
from server.ingress.http_server import HttpListener
from server.ingress.routes import Reply, Routes
from server.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from server.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

MAX_PUBLISH_BYTES = 128 * 1024  # today's API Gateway message limit
MAX_IDEMPOTENCY_KEY = 200
IDEMPOTENCY_PREFIX = "http:"
"""Names from publishers live apart from the bridges' and the server's own."""


def event_name(request: Request) -> str | None:
    """The event's name: the publisher's key, or a new one. None: a bad key."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return new_event_id()
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY or not key.isprintable():
        return None
    return IDEMPOTENCY_PREFIX + key


class HttpHub(status.StatusSource, Protocol):
    """What the internal HTTP listener needs of the hub (``server.node.Node`` is one)."""

    @property
    def node_id(self) -> str: ...

    async def publish(
        self, message: Broadcast, *, event_id: str | None = None
    ) -> dict[str, Position]: ...

    def readiness(self) -> dict[str, bool]: ...


def build_routes(node: HttpHub, settings: Settings) -> tuple[Routes, status.History]:
    secret = settings.publish_secret
    expected = f"Bearer {secret}".encode() if secret is not None else b""

    async def publish(request: Request) -> Reply:
        if secret is None:
            return Reply.error(503, "publishing is disabled: no --publish-secret is set")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), expected):
            return Reply.error(401, "missing or wrong bearer secret")
        try:
            message = parse_broadcast(request.body)
        except ProtocolError as exc:
            return Reply.error(400, exc.message, code=exc.code)
        event_id = event_name(request)
        if event_id is None:
            return Reply.error(
                400, f"Idempotency-Key: 1 to {MAX_IDEMPOTENCY_KEY} printable characters"
            )
        try:
            positions = await node.publish(message, event_id=event_id)
        except Exception as exc:
            log.warning("publish failed: %s", exc)
            return Reply.error(503, "the bus could not take the event")
        reply: dict[str, object] = {"accepted": True}
        if not isinstance(message.event, AdminTest):
            # Empty when Redis was away and only this node's clients heard it.
            reply["positions"] = {
                stream: {"epoch": p.epoch, "offset": p.offset} for stream, p in positions.items()
            }
        return Reply.json(202, reply)

    async def healthz(request: Request) -> Reply:
        return Reply.json(200, {"status": "ok", "node": node.node_id})

    async def readyz(request: Request) -> Reply:
        checks = node.readiness()
        ready = all(checks.values())
        return Reply.json(200 if ready else 503, {"ready": ready, **checks})

    async def metrics(request: Request) -> Reply:
        return Reply(200, node.metrics.render().encode(), METRICS_CONTENT_TYPE)

    routes = Routes()
    routes.add("POST", "/publish", publish)
    routes.add("GET", "/healthz", healthz)
    routes.add("GET", "/readyz", readyz)
    routes.add("GET", "/metrics", metrics)
    history = status.add_routes(routes, node, settings)
    return routes, history


class InternalHttp:
    """The running listener, and the status page's sampling beside it."""

    def __init__(self, node: HttpHub, settings: Settings) -> None:
        routes, self._history = build_routes(node, settings)
        self._settings = settings
        self.listener = HttpListener(routes, MAX_PUBLISH_BYTES)
        self._sampling: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.listener.start(self._settings.http_host, self._settings.http_port)
        self._sampling = asyncio.create_task(self._history.run(), name="status-history")

    @property
    def port(self) -> int:
        return self.listener.port

    async def stop(self) -> None:
        if self._sampling is not None:
            await cancel_and_wait(self._sampling)
        await self.listener.stop()
