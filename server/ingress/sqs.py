"""The queue bridge: today's broadcast queue (``WEBSOCKET_SQS``) into the cluster.

The live backend sends every broadcast to an SQS queue, body
``{"verb", "payload", "exclude"}``. With ``--sqs-queue-url`` each node long-polls
that queue and publishes each message through the same parsing and the same
door as ``POST /publish``, so the backend changes nothing on day one.

- **Delete after publish.** A message is deleted only once its event was
  accepted onto the bus for every node (``require_cluster``). When SQS, Redis or
  the bus is down the poller backs off with jitter and the message stays in the
  queue, to be received again.
- **Exactly once for clients.** SQS delivers at least once, sometimes to two
  nodes at once. Each MessageId is claimed in :mod:`server.coordination.dedup` before it is
  published and marked done after, for 15 minutes, so every node may run the
  bridge (competing consumers) and each message reaches clients once. A message
  another node is publishing right now is handed back to the queue for a few
  seconds and then found done.
  A consumer killed between publishing and marking done leaves a claim that
  expires, and another node publishes the message again: that append names the
  MessageId as its event id, so the stream answers the position it took the
  first time and publishes nothing (``server/bus/streams.py``).
- **Poison.** A body that does not parse is logged with its MessageId, counted
  and deleted: the live queue has no dead-letter queue, and retrying cannot fix it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aioboto3
from botocore.config import Config

from protocol.errors import ProtocolError
from protocol.messages import Broadcast
from protocol.parse import parse_broadcast
from server.bus.base import Bus
from server.coordination.dedup import Claim, Dedup
from server.runtime.metrics import REGISTRY
from server.services import Publish

log = logging.getLogger(__name__)

MAX_MESSAGES = 10
"""ReceiveMessage and DeleteMessageBatch take at most 10 messages."""
DEDUP_PREFIX = "ap:sqs:"
DEDUP_SECONDS = 900.0
"""How long a published MessageId is remembered: SQS's own dedup window for FIFO queues,
far longer than the visibility timeout after which a message could come back."""
BUSY_RETRY_SECONDS = 5
"""A message another consumer is publishing comes back this much later (then reads done)."""
BACKOFF_BASE_SECONDS = 0.2
BACKOFF_CAP_SECONDS = 5.0
DELETE_ATTEMPTS = 3
STOP_GRACE_SECONDS = 5.0
BUS_SETTLE_SECONDS = 3.0
"""After the bus reconnects, wait this long before publishing again: the other nodes'
subscribers reconnect within the bus's 2 s backoff cap, and Redis pub/sub would not
deliver to a node that is not subscribed yet."""

received = REGISTRY.counter("ap_sqs_messages_received_total", "Messages received from the queue")
published = REGISTRY.counter(
    "ap_sqs_messages_published_total", "Queue messages published onto the bus"
)
duplicates = REGISTRY.counter(
    "ap_sqs_duplicates_total", "Queue messages received again after they were published"
)
poison = REGISTRY.counter(
    "ap_sqs_poison_messages_total", "Queue messages that did not parse: logged and deleted"
)
handed_back = REGISTRY.counter(
    "ap_sqs_messages_returned_total",
    "Messages handed back to the queue unpublished (bus down, or another node publishing)",
)
errors = REGISTRY.counter(
    "ap_sqs_errors_total", "Failed calls to SQS or to the dedup store (then backed off)"
)


def backoff_delay(failures: int) -> float:
    """Jittered exponential backoff: pollers of many nodes do not retry in step."""
    ceiling = min(BACKOFF_CAP_SECONDS, BACKOFF_BASE_SECONDS * 2 ** min(failures, 10))
    return random.uniform(ceiling / 2, ceiling)


@dataclass
class _Received:
    message_id: str
    receipt: str
    body: str
    sent_ms: int | None


def _sent_ms(message: dict[str, Any]) -> int | None:
    raw = message.get("Attributes", {}).get("SentTimestamp")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


class SqsBridge:
    """Long-polls one queue with ``pollers`` concurrent receivers on this node."""

    def __init__(
        self,
        publish: Publish,
        bus: Bus,
        dedup: Dedup,
        queue_url: str,
        *,
        node_id: str,
        region: str,
        endpoint_url: str | None = None,
        pollers: int = 4,
        wait_seconds: int = 20,
        visibility_seconds: int = 30,
    ) -> None:
        self._publish = publish
        self._bus = bus
        self._dedup = dedup
        self.queue_url = queue_url
        self._region = region
        self._endpoint_url = endpoint_url
        self._pollers = pollers
        self._wait = wait_seconds
        self._visibility = visibility_seconds
        self._token = f"{node_id}/{uuid.uuid4().hex}"
        self._batches = 0
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._receiving: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._settle = BUS_SETTLE_SECONDS
        self._in_flight = 0
        self._oldest_ms: dict[int, float] = {}
        REGISTRY.gauge(
            "ap_sqs_messages_in_flight",
            "Messages received from the queue and not yet deleted or handed back",
            lambda: float(self._in_flight),
        )
        REGISTRY.gauge(
            "ap_sqs_oldest_message_age_seconds",
            "Age, when received, of the oldest message of the latest receives (0: queue drained)",
            self._oldest_age,
        )

    def _oldest_age(self) -> float:
        return max(self._oldest_ms.values(), default=0.0) / 1000

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        stack = contextlib.AsyncExitStack()
        session = aioboto3.Session()
        config = Config(
            connect_timeout=2,
            read_timeout=self._wait + 10,  # a long poll holds the request for up to wait s
            retries={"mode": "standard", "total_max_attempts": 1},  # our loop retries
            max_pool_connections=self._pollers * 2 + 2,
        )
        self._client = await stack.enter_async_context(
            session.client(
                "sqs", region_name=self._region, endpoint_url=self._endpoint_url, config=config
            )
        )
        self._stack = stack
        self._stopping = False
        self._tasks = [
            asyncio.create_task(self._poll(index), name=f"sqs-poller-{index}")
            for index in range(self._pollers)
        ]
        log.info(
            "queue bridge on %s: %d pollers, %d s long polls, %d s visibility",
            self.queue_url,
            self._pollers,
            self._wait,
            self._visibility,
        )

    async def stop(self) -> None:
        """Stop receiving; let batches being published finish, then close."""
        self._stopping = True
        for task in self._receiving:
            task.cancel()  # a long poll holds nothing: its messages were not received yet
        if self._tasks:
            _done, pending = await asyncio.wait(self._tasks, timeout=STOP_GRACE_SECONDS)
            for task in pending:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks = []
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()
        await self._dedup.close()

    # --- polling ------------------------------------------------------------

    async def _poll(self, index: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        failures = 0
        while not self._stopping:
            if not self._bus_settled():
                # Nothing could be published to every node: leave the messages in the queue.
                failures += 1
                await self._pause(failures, "the bus is down or just reconnected")
                continue
            self._receiving.add(task)
            try:
                response = await self._client.receive_message(
                    QueueUrl=self.queue_url,
                    MaxNumberOfMessages=MAX_MESSAGES,
                    WaitTimeSeconds=self._wait,
                    VisibilityTimeout=self._visibility,
                    MessageSystemAttributeNames=["SentTimestamp"],
                )
            except asyncio.CancelledError:
                if self._stopping:
                    return
                raise
            except Exception as exc:
                errors.inc()
                failures += 1
                await self._pause(failures, f"ReceiveMessage failed: {exc}")
                continue
            finally:
                self._receiving.discard(task)
            batch = [
                _Received(m["MessageId"], m["ReceiptHandle"], m.get("Body", ""), _sent_ms(m))
                for m in response.get("Messages", [])
            ]
            self._note_lag(index, batch)
            if not batch:
                failures = 0
                continue
            try:
                ok = await self._handle(batch)
            except Exception:
                # Not expected; the messages come back after the visibility timeout.
                log.exception("queue bridge: a batch failed")
                ok = False
            if ok:
                failures = 0
            else:
                failures += 1
                await self._pause(failures, "publishing failed; messages handed back")

    def _bus_settled(self) -> bool:
        bus = self._bus
        if not bus.connected:
            return False
        since: float | None = getattr(bus, "reconnected_at", None)  # the Redis bus only
        return since is None or time.monotonic() - since >= self._settle

    async def _pause(self, failures: int, reason: str) -> None:
        delay = backoff_delay(failures)
        if failures == 1 or failures % 10 == 0:
            log.warning("queue bridge: %s; retrying in %.2fs", reason, delay)
        await asyncio.sleep(delay)

    def _note_lag(self, index: int, batch: Sequence[_Received]) -> None:
        sent = [m.sent_ms for m in batch if m.sent_ms is not None]
        self._oldest_ms[index] = max(0.0, time.time() * 1000 - min(sent)) if sent else 0.0

    # --- one batch ----------------------------------------------------------

    async def _handle(self, batch: list[_Received]) -> bool:
        """Publish a batch; True unless something failed and messages were handed back."""
        received.inc(len(batch))
        self._in_flight += len(batch)
        try:
            return await self._publish_batch(batch)
        finally:
            self._in_flight -= len(batch)

    async def _publish_batch(self, batch: list[_Received]) -> bool:
        done: list[_Received] = []
        events: list[tuple[_Received, Broadcast]] = []
        for message in batch:
            try:
                events.append((message, parse_broadcast(message.body)))
            except ProtocolError as exc:
                poison.inc()
                log.warning(
                    "queue bridge: poison message %s deleted: %s (%s)",
                    message.message_id,
                    exc.message,
                    exc.code,
                )
                done.append(message)
        keys = [DEDUP_PREFIX + message.message_id for message, _ in events]
        # A token per batch, not per node: SQS may hand one message to two pollers of
        # this node at once, and the second must find it claimed, not "already ours".
        self._batches += 1
        token = f"{self._token}/{self._batches}"
        try:
            # Twice the visibility timeout: if publishing stalls past it and SQS hands
            # the message to another node, that node finds the claim and waits, rather
            # than publishing it a second time.
            claims = await self._dedup.claim(keys, token, 2 * self._visibility)
        except Exception as exc:
            errors.inc()
            log.warning("queue bridge: dedup store unreachable: %s", exc)
            await self._delete(done)
            await self._hand_back([m for m, _ in events], BUSY_RETRY_SECONDS)
            return False
        completed: list[str] = []
        later: list[_Received] = []
        unpublished: list[str] = []
        ok = True
        for (message, event), key, claim in zip(events, keys, claims, strict=True):
            if claim is Claim.DONE:
                duplicates.inc()
                done.append(message)
            elif claim is Claim.BUSY:
                later.append(message)
            elif not ok:
                unpublished.append(key)
                later.append(message)
            else:
                try:
                    await self._publish(event, require_cluster=True, event_id=message.message_id)
                except Exception as exc:
                    ok = False
                    errors.inc()
                    log.warning("queue bridge: publish of %s failed: %s", message.message_id, exc)
                    unpublished.append(key)
                    later.append(message)
                else:
                    published.inc()
                    completed.append(key)
                    done.append(message)
        try:
            await self._dedup.complete(completed, DEDUP_SECONDS)
            await self._dedup.release(unpublished, token)
        except Exception as exc:
            # Published but not marked: a redelivery within the visibility
            # timeout finds our claim (BUSY), after it the claim lapsed. The
            # delete below makes a redelivery unlikely.
            errors.inc()
            log.warning("queue bridge: could not mark messages published: %s", exc)
        await self._delete(done)
        if later:
            await self._hand_back(later, BUSY_RETRY_SECONDS if ok else None)
        return ok

    async def _delete(self, messages: Sequence[_Received]) -> None:
        """DeleteMessageBatch, retried; a message left behind comes back and reads done."""
        pending = list(messages)
        for attempt in range(1, DELETE_ATTEMPTS + 1):
            if not pending:
                return
            entries = [{"Id": str(i), "ReceiptHandle": m.receipt} for i, m in enumerate(pending)]
            try:
                response = await self._client.delete_message_batch(
                    QueueUrl=self.queue_url, Entries=entries
                )
            except Exception as exc:
                errors.inc()
                reason = str(exc)
            else:
                failed = {entry["Id"] for entry in response.get("Failed", [])}
                pending = [m for i, m in enumerate(pending) if str(i) in failed]
                reason = f"{len(failed)} entries failed"
                if not pending:
                    return
            if attempt < DELETE_ATTEMPTS:
                await asyncio.sleep(backoff_delay(attempt))
        log.warning(
            "queue bridge: %d published messages not deleted (%s); they will come back "
            "and be deleted as duplicates",
            len(pending),
            reason,
        )

    async def _hand_back(self, messages: Sequence[_Received], seconds: int | None) -> None:
        """Make unpublished messages visible again soon, rather than after the timeout."""
        handed_back.inc(len(messages))
        delay = seconds if seconds is not None else max(1, round(backoff_delay(3)))
        entries = [
            {"Id": str(i), "ReceiptHandle": m.receipt, "VisibilityTimeout": delay}
            for i, m in enumerate(messages)
        ]
        try:
            await self._client.change_message_visibility_batch(
                QueueUrl=self.queue_url, Entries=entries
            )
        except Exception as exc:
            # They come back after the visibility timeout instead: later, not lost.
            errors.inc()
            log.warning("queue bridge: could not hand %d messages back: %s", len(messages), exc)
