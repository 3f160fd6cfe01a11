"""The internal HTTP listener: publish, health, readiness, metrics, the operator's page.

It listens apart from the public WebSocket port so that a load balancer
exposes only the latter; the backend and operators reach this one.

Every published event is named before its first attempt: by the publisher's
``Idempotency-Key`` header (a retry of the same request, even after a 503 or
a lost answer, is appended once and answered with the first positions), or
else by a name made here, which every internal retry reuses.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Protocol

from aiohttp import web

from protocol.errors import ProtocolError
from protocol.messages import AdminTest, Broadcast, Position
from protocol.parse import parse_broadcast
from server.bus.streams import new_event_id
from server.config import Settings
from server.ingress import status
from server.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

log = logging.getLogger(__name__)

MAX_PUBLISH_BYTES = 128 * 1024  # today's API Gateway message limit
MAX_IDEMPOTENCY_KEY = 200
IDEMPOTENCY_PREFIX = "http:"
"""Names from publishers live apart from the bridges' and the server's own."""


def event_name(request: web.Request) -> str | None:
    """The event's name: the publisher's key, or a new one. None: a bad key."""
    key = request.headers.get("Idempotency-Key")
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


def _json(status: int, body: dict[str, object]) -> web.Response:
    return web.json_response(body, status=status)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, or its first ``limit`` bytes: ``content.read(n)`` returns
    only what has arrived so far, so a body split across TCP writes needs a loop."""
    parts: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await request.content.read(limit - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


def build_app(node: HttpHub, settings: Settings) -> web.Application:
    secret = settings.publish_secret

    async def publish(request: web.Request) -> web.Response:
        if secret is None:
            return _json(503, {"error": "publishing is disabled: no --publish-secret is set"})
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {secret}".encode()):
            return _json(401, {"error": "missing or wrong bearer secret"})
        if request.content_length is not None and request.content_length > MAX_PUBLISH_BYTES:
            return _json(413, {"error": f"body over {MAX_PUBLISH_BYTES} bytes"})
        body = await read_body(request, MAX_PUBLISH_BYTES + 1)
        if len(body) > MAX_PUBLISH_BYTES:
            return _json(413, {"error": f"body over {MAX_PUBLISH_BYTES} bytes"})
        try:
            message = parse_broadcast(body)
        except ProtocolError as exc:
            return _json(400, {"error": exc.message, "code": exc.code})
        event_id = event_name(request)
        if event_id is None:
            return _json(
                400,
                {"error": f"Idempotency-Key: 1 to {MAX_IDEMPOTENCY_KEY} printable characters"},
            )
        try:
            positions = await node.publish(message, event_id=event_id)
        except Exception as exc:
            log.warning("publish failed: %s", exc)
            return _json(503, {"error": "the bus could not take the event"})
        reply: dict[str, object] = {"accepted": True}
        if not isinstance(message.event, AdminTest):
            # Empty when Redis was away and only this node's clients heard it.
            reply["positions"] = {
                stream: {"epoch": p.epoch, "offset": p.offset} for stream, p in positions.items()
            }
        return _json(202, reply)

    async def healthz(request: web.Request) -> web.Response:
        return _json(200, {"status": "ok", "node": node.node_id})

    async def readyz(request: web.Request) -> web.Response:
        checks = node.readiness()
        status = 200 if all(checks.values()) else 503
        return web.Response(
            status=status,
            text=json.dumps({"ready": status == 200, **checks}),
            content_type="application/json",
        )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=node.metrics.render().encode(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    app = web.Application(client_max_size=MAX_PUBLISH_BYTES)
    app.router.add_post("/publish", publish)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    status.add_routes(app, node, settings)
    return app
