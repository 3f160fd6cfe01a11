"""The bot queue bridge: today's bot outbound queue to bots, over WebSocket or webhook.

After every move, pie, accepted challenge and admin ``ping_bot`` the live backend
enqueues ``{"type":"move","metaGame","gameid","botId"}`` or
``{"type":"challenge","challengeId","metaGame","botId","standing"}`` on
``BOT_OUTBOUND_QUEUE_URL``. With ``--bot-queue-url`` every node consumes that
queue (the shared core, :mod:`server.ingress.queue_core`: claims, deletes after
delivery, poison, lag), and each message goes one of two ways:

- its bot holds a WebSocket session somewhere in the cluster
  (:mod:`server.coordination.bot_sessions`): ``yourTurn {meta, id}`` or
  ``challenge {challengeId, meta, standing}`` on ``user:<botId>``, appended under
  the MessageId, so a second delivery takes no second position;
- it has none: the body is forwarded byte for byte to ``--bot-webhook-queue-url``,
  which today's webhook Lambda reads after the switch.

**Challenges.** Today a bot accepts a challenge only by answering its webhook with
200: ``POST /botQuery`` has no verb for it. Where bots must be able to accept,
``--bot-challenges-by-webhook`` forwards every ``challenge`` whatever the bot's
sessions (a connected bot still gets its turns over WebSocket).

**Never both, never twice.** The way is decided once per MessageId and kept in the
dedup store (``ap:botq:route:<id>``) for the dedup window: a consumer killed after
it decided, or after it delivered but before it marked the message done, leaves
the decision to the next one, which follows it. On a FIFO forward queue the send
carries the MessageId as its deduplication id, so a second send of one message is
dropped by SQS itself; the forward queue must be FIFO for that window
(``docs/operations.md``).

**No lost turn.** A ``move`` first leaves its game as a candidate of the bot
(``BOTTURNS#<botId>``), before the way is chosen: a bot that connects just after
its message was forwarded reads the candidate in ``pendingTurns`` (its session is
marked before it reads, ``server.services.bots``). A bot that disconnects just after
the WebSocket way was chosen finds the event in its user stream with ``since``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from protocol.errors import ProtocolError
from protocol.messages import BotOutbound, Broadcast
from protocol.parse import parse_bot_outbound
from server.bus.base import Bus
from server.coordination.bot_sessions import BotSessions
from server.coordination.dedup import Claim, Dedup
from server.ingress.queue_core import (
    DEDUP_SECONDS,
    Poison,
    QueueBridge,
    QueuePolling,
    _Received,
)
from server.runtime.metrics import Registry
from server.services import Publish
from server.store.base import Store

log = logging.getLogger(__name__)

ROUTE_PREFIX = "ap:botq:route:"
WEBSOCKET = "ws"
FORWARD = "fwd"


class BotQueueBridge(QueueBridge[BotOutbound]):
    """The bot outbound queue into bots' user streams, or on to the webhook queue."""

    NAME = "bot queue bridge"
    METRICS = "ap_bot_queue"
    DEDUP_PREFIX = "ap:botq:"

    def __init__(
        self,
        publish: Publish,
        bus: Bus,
        dedup: Dedup,
        store: Store,
        sessions: BotSessions,
        polling: QueuePolling,
        webhook_queue_url: str,
        *,
        challenges_by_webhook: bool = False,
        owns_store: bool = False,
        metrics: Registry,
    ) -> None:
        super().__init__(bus, dedup, polling, metrics=metrics)
        self._publish = publish
        self._route_dedup = dedup
        self._store = store
        self._owns_store = owns_store  # its own client: started and closed with the bridge
        self._sessions = sessions
        self.webhook_queue_url = webhook_queue_url
        self._fifo = webhook_queue_url.endswith(".fifo")
        self.challenges_by_webhook = challenges_by_webhook
        self._to_socket = metrics.counter(
            "ap_bot_queue_to_websocket_total", "Bot messages published on the bot's user stream"
        )
        self._forwarded = metrics.counter(
            "ap_bot_queue_forwarded_total", "Bot messages forwarded to the webhook queue"
        )
        self._candidates = metrics.counter(
            "ap_bot_queue_candidates_total", "BOTTURNS# candidates written for move messages"
        )

    async def start(self) -> None:
        if self._owns_store:
            await self._store.start()
        try:
            await super().start()
        except BaseException:
            if self._owns_store:
                await self._store.close()
            raise

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            if self._owns_store:
                await self._store.close()

    def parse(self, body: str) -> BotOutbound:
        try:
            return parse_bot_outbound(body)
        except ProtocolError as exc:
            raise Poison(f"{exc.message} ({exc.code})") from exc

    async def prepare(self, claimed: Sequence[tuple[_Received, BotOutbound]]) -> None:
        """The batch's moves become candidates, in one write: before any way is chosen,
        so a bot connecting from now on reads them in its pendingTurns."""
        moves = [(m.bot_id, m.meta, m.game_id) for _, m in claimed if m.type == "move"]
        if moves:
            await self._store.add_bot_candidates(moves, int(time.time() * 1000))
            self._candidates.inc(len(set(moves)))

    async def deliver(self, message: _Received, parsed: BotOutbound) -> None:
        if self.challenges_by_webhook and parsed.type == "challenge":
            # One way whoever reads it, so no route to record.
            route = FORWARD
        else:
            route = await self._route(message.message_id, parsed.bot_id)
        if route == WEBSOCKET:
            broadcast = Broadcast(event=parsed.event())
            await self._publish(broadcast, require_cluster=True, event_id=message.message_id)
            self._to_socket.inc()
        else:
            await self._forward(message, parsed)
            self._forwarded.inc()

    async def _route(self, message_id: str, bot_id: str) -> str:
        """The way of this message: chosen now, or the one chosen before."""
        choice = WEBSOCKET if await self._sessions.connected(bot_id) else FORWARD
        # The route key is claimed with the route as its token: the same route
        # reads CLAIMED again, the other one BUSY (then that one was chosen).
        (claim,) = await self._route_dedup.claim([ROUTE_PREFIX + message_id], choice, DEDUP_SECONDS)
        if claim is Claim.BUSY:
            return FORWARD if choice == WEBSOCKET else WEBSOCKET
        return choice

    async def _forward(self, message: _Received, parsed: BotOutbound) -> None:
        params: dict[str, Any] = {"QueueUrl": self.webhook_queue_url, "MessageBody": message.body}
        if self._fifo:
            params["MessageGroupId"] = parsed.bot_id
            params["MessageDeduplicationId"] = message.message_id
        await self._client.send_message(**params)
