"""The queue bridge: today's broadcast queue (``WEBSOCKET_SQS``) into the cluster.

The live backend sends every broadcast to an SQS queue, body
``{"verb", "payload", "exclude"}``. With ``--sqs-queue-url`` each node long-polls
that queue and publishes each message through the same parsing and the same
door as ``POST /publish``, so the backend changes nothing on day one.

The polling, claims, deletes and hand-backs are the shared core's
(:mod:`server.ingress.queue_core`). A message is deleted only once its event was
accepted onto the bus for every node (``require_cluster``). A consumer killed
between publishing and marking done leaves a claim that expires, and another
node publishes the message again: that append names the MessageId as its event
id, so the stream answers the position it took the first time and publishes
nothing (``server/bus/streams.py``).
"""

from __future__ import annotations

from protocol.errors import ProtocolError
from protocol.messages import Broadcast
from protocol.parse import parse_broadcast
from server.bus.base import Bus
from server.coordination.dedup import Dedup
from server.ingress.queue_core import Poison, QueueBridge, QueuePolling, _Received
from server.runtime.metrics import Registry
from server.services import Publish

__all__ = ["DEDUP_PREFIX", "SqsBridge", "_Received"]

DEDUP_PREFIX = "ap:sqs:"


class SqsBridge(QueueBridge[Broadcast]):
    """Today's broadcast bodies into ``Node.publish``, once per message."""

    NAME = "queue bridge"
    METRICS = "ap_sqs"
    DEDUP_PREFIX = DEDUP_PREFIX

    def __init__(
        self, publish: Publish, bus: Bus, dedup: Dedup, polling: QueuePolling, *, metrics: Registry
    ) -> None:
        super().__init__(bus, dedup, polling, metrics=metrics)
        self._publish = publish

    def parse(self, body: str) -> Broadcast:
        try:
            return parse_broadcast(body)
        except ProtocolError as exc:
            raise Poison(f"{exc.message} ({exc.code})") from exc

    async def deliver(self, message: _Received, parsed: Broadcast) -> None:
        await self._publish(parsed, require_cluster=True, event_id=message.message_id)
