"""The internal HTTP listener: publish, health, readiness, metrics, the operator's page.

It listens apart from the public WebSocket port so that a load balancer
exposes only the latter; the backend and operators reach this one.
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
from server.config import Settings
from server.ingress import status
from server.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

log = logging.getLogger(__name__)

MAX_PUBLISH_BYTES = 128 * 1024  # today's API Gateway message limit


class HttpHub(status.StatusSource, Protocol):
    """What the internal HTTP listener needs of the hub (``server.node.Node`` is one)."""

    @property
    def node_id(self) -> str: ...

    async def publish(self, message: Broadcast) -> dict[str, Position]: ...

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
        try:
            positions = await node.publish(message)
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
