"""The core both queue bridges share: long polls, claims, deletes, hand-backs, lag.

A bridge (:mod:`server.ingress.sqs`, :mod:`server.ingress.bot_queue`) says how a
body parses and how one parsed message is delivered; this core gives every
bridge the same guarantees:

- **Delete after delivery.** A message is deleted only once ``deliver`` returned
  (the bus accepted its event for every node, or it was forwarded). When SQS,
  Redis or the bus is down the poller backs off with jitter and the message
  stays in the queue, to be received again.
- **Once per MessageId.** SQS delivers at least once, sometimes to two nodes at
  once. Each MessageId is claimed in :mod:`server.coordination.dedup` before it is
  delivered and marked done after, for 15 minutes, so every node may consume
  (competing consumers). A message another node is delivering right now is
  handed back to the queue for a few seconds and then found done. A consumer
  killed between delivering and marking done leaves a claim that expires, and
  another node delivers again: each bridge makes that second delivery a no-op
  (the append is named by the MessageId; see the bridges).
- **Poison.** A body that does not parse is logged with its MessageId, counted
  and deleted: the live queues have no dead-letter queue, and retrying cannot fix it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import aioboto3

from server.aws import client_config
from server.bus.base import Bus
from server.coordination.dedup import Claim, Dedup
from server.runtime.backoff import Backoff, Retrying
from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_all_and_wait

log = logging.getLogger(__name__)

MAX_MESSAGES = 10
"""ReceiveMessage and DeleteMessageBatch take at most 10 messages."""
DEDUP_SECONDS = 900.0
"""How long a published MessageId is remembered: SQS's own dedup window for FIFO queues,
far longer than the visibility timeout after which a message could come back."""
BUSY_RETRY_SECONDS = 5
"""A message another consumer is publishing comes back this much later (then reads done)."""
BACKOFF = Backoff(first=0.4, cap=5.0)
"""Pollers of many nodes do not retry in step."""
DELETE_BACKOFF = replace(BACKOFF, attempts=3)
SLOW_BATCH_SECONDS = 1.0
"""A batch slower than this from receive to delete is logged, step by step."""
STOP_GRACE_SECONDS = 5.0
BUS_SETTLE_SECONDS = 3.0
"""After the bus reconnects, wait this long before publishing again: the other nodes'
subscribers reconnect within the bus's 2 s backoff cap, and Redis pub/sub would not
deliver to a node that is not subscribed yet."""


class Poison(Exception):
    """A body that can never be delivered: logged, counted and deleted."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Counters:
    """A bridge's counters, on its node's registry, named ``<prefix>_...``."""

    def __init__(self, registry: Registry, prefix: str) -> None:
        self.received = registry.counter(
            f"{prefix}_messages_received_total", "Messages received from the queue"
        )
        self.published = registry.counter(
            f"{prefix}_messages_published_total", "Queue messages delivered (published, forwarded)"
        )
        self.duplicates = registry.counter(
            f"{prefix}_duplicates_total", "Queue messages received again after they were delivered"
        )
        self.poison = registry.counter(
            f"{prefix}_poison_messages_total", "Queue messages that did not parse (deleted)"
        )
        self.handed_back = registry.counter(
            f"{prefix}_messages_returned_total",
            "Messages handed back to the queue undelivered (bus down, or another node delivering)",
        )
        self.errors = registry.counter(
            f"{prefix}_errors_total", "Failed calls to SQS or to the dedup store (then backed off)"
        )


Parsed = TypeVar("Parsed")


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


@dataclass(frozen=True, slots=True)
class QueuePolling:
    """Which queue a bridge reads, and how (the ``--sqs-*`` settings both bridges share)."""

    queue_url: str
    node_id: str
    region: str
    endpoint_url: str | None = None
    pollers: int = 4
    wait_seconds: int = 20
    visibility_seconds: int = 30


class QueueBridge(Generic[Parsed]):
    """Long-polls one queue with ``pollers`` concurrent receivers on this node.

    A bridge sets ``NAME`` (log lines), ``METRICS`` (metric prefix) and
    ``DEDUP_PREFIX`` (its claims' keys), and implements ``parse`` and ``deliver``.
    """

    NAME = "queue bridge"
    METRICS = "ap_sqs"
    DEDUP_PREFIX = "ap:sqs:"

    def parse(self, body: str) -> Parsed:
        """The message, or :class:`Poison`."""
        raise NotImplementedError

    async def prepare(self, claimed: Sequence[tuple[_Received, Parsed]]) -> None:
        """Work for the whole batch's claimed messages at once, before each is
        delivered in order (the bot bridge's candidate writes); raise to hand the
        batch back undelivered."""

    async def deliver(self, message: _Received, parsed: Parsed) -> None:
        """Deliver one claimed message, at most once in effect however often it is
        called for one MessageId; raise to hand it back undelivered."""
        raise NotImplementedError

    def __init__(self, bus: Bus, dedup: Dedup, polling: QueuePolling, *, metrics: Registry) -> None:
        self._bus = bus
        self._metrics = metrics
        m = self.METRICS
        self._counts = _Counters(metrics, m)
        self._dedup = dedup
        self.queue_url = polling.queue_url
        self._region = polling.region
        self._endpoint_url = polling.endpoint_url
        self._pollers = polling.pollers
        self._wait = polling.wait_seconds
        self._visibility = polling.visibility_seconds
        self._token = f"{polling.node_id}/{uuid.uuid4().hex}"
        self._batches = 0
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._receiving: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._settle = BUS_SETTLE_SECONDS
        self._in_flight = 0
        self._oldest_ms: dict[int, float] = {}
        self._metrics.gauge(
            f"{m}_messages_in_flight",
            "Messages received from the queue and not yet deleted or handed back",
            lambda: float(self._in_flight),
        )
        self._metrics.gauge(
            f"{m}_oldest_message_age_seconds",
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
        self._client = await stack.enter_async_context(
            sqs_client(self._region, self._endpoint_url, self._wait, self._pollers * 2 + 2)
        )
        self._stack = stack
        self._stopping = False
        self._tasks = [
            asyncio.create_task(self._poll(index), name=f"sqs-poller-{index}")
            for index in range(self._pollers)
        ]
        log.info(
            "%s on %s: %d pollers, %d s long polls, %d s visibility",
            self.NAME,
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
            await cancel_all_and_wait(pending)
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
        retrying = BACKOFF.start()
        while not self._stopping:
            if not self._bus_settled():
                # Nothing could be published to every node: leave the messages in the queue.
                await self._pause(retrying, "the bus is down or just reconnected")
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
                self._counts.errors.inc()
                await self._pause(retrying, f"ReceiveMessage failed: {exc}")
                continue
            finally:
                self._receiving.discard(task)
            batch = [
                _Received(m["MessageId"], m["ReceiptHandle"], m.get("Body", ""), _sent_ms(m))
                for m in response.get("Messages", [])
            ]
            self._note_lag(index, batch)
            if not batch:
                retrying.reset()
                continue
            try:
                ok = await self._handle(batch)
            except Exception:
                # Not expected; the messages come back after the visibility timeout.
                log.exception("%s: a batch failed", self.NAME)
                ok = False
            if ok:
                retrying.reset()
            else:
                await self._pause(retrying, "publishing failed; messages handed back")

    def _bus_settled(self) -> bool:
        bus = self._bus
        if not bus.connected:
            return False
        since: float | None = getattr(bus, "reconnected_at", None)  # the Redis bus only
        return since is None or time.monotonic() - since >= self._settle

    async def _pause(self, retrying: Retrying, reason: str) -> None:
        delay = retrying.next_delay()
        assert delay is not None  # no limit, no deadline: the poller retries for ever
        if retrying.failures == 1 or retrying.failures % 10 == 0:
            log.warning("%s: %s; retrying in %.2fs", self.NAME, reason, delay)
        await asyncio.sleep(delay)

    def _note_lag(self, index: int, batch: Sequence[_Received]) -> None:
        sent = [m.sent_ms for m in batch if m.sent_ms is not None]
        self._oldest_ms[index] = max(0.0, time.time() * 1000 - min(sent)) if sent else 0.0

    # --- one batch ----------------------------------------------------------

    async def _handle(self, batch: list[_Received]) -> bool:
        """Publish a batch; True unless something failed and messages were handed back."""
        self._counts.received.inc(len(batch))
        self._in_flight += len(batch)
        try:
            return await self._publish_batch(batch)
        finally:
            self._in_flight -= len(batch)

    async def _publish_batch(self, batch: list[_Received]) -> bool:
        done: list[_Received] = []
        events: list[tuple[_Received, Parsed]] = []
        for message in batch:
            try:
                events.append((message, self.parse(message.body)))
            except Poison as exc:
                self._counts.poison.inc()
                log.warning(
                    "%s: poison message %s deleted: %s", self.NAME, message.message_id, exc.reason
                )
                done.append(message)
        keys = [self.DEDUP_PREFIX + message.message_id for message, _ in events]
        # A token per batch, not per node: SQS may hand one message to two pollers of
        # this node at once, and the second must find it claimed, not "already ours".
        self._batches += 1
        token = f"{self._token}/{self._batches}"
        steps = _Steps()
        try:
            # Twice the visibility timeout: if publishing stalls past it and SQS hands
            # the message to another node, that node finds the claim and waits, rather
            # than publishing it a second time.
            claims = await self._dedup.claim(keys, token, 2 * self._visibility)
        except Exception as exc:
            self._counts.errors.inc()
            log.warning("%s: dedup store unreachable: %s", self.NAME, exc)
            await self._delete(done)
            await self._hand_back([m for m, _ in events], BUSY_RETRY_SECONDS)
            return False
        completed: list[str] = []
        later: list[_Received] = []
        unpublished: list[str] = []
        ok = True
        steps.done("claim")
        claimed = [e for e, claim in zip(events, claims, strict=True) if claim is Claim.CLAIMED]
        try:
            if claimed:
                await self.prepare(claimed)
        except Exception as exc:
            ok = False
            self._counts.errors.inc()
            log.warning("%s: a batch could not be prepared: %s", self.NAME, exc)
        steps.done("prepare")
        for (message, event), key, claim in zip(events, keys, claims, strict=True):
            if claim is Claim.DONE:
                self._counts.duplicates.inc()
                done.append(message)
            elif claim is Claim.BUSY:
                later.append(message)
            elif not ok:
                unpublished.append(key)
                later.append(message)
            else:
                try:
                    await self.deliver(message, event)
                except Exception as exc:
                    ok = False
                    self._counts.errors.inc()
                    log.warning("%s: delivery of %s failed: %s", self.NAME, message.message_id, exc)
                    unpublished.append(key)
                    later.append(message)
                else:
                    self._counts.published.inc()
                    completed.append(key)
                    done.append(message)
        steps.done("deliver")
        try:
            await self._dedup.complete(completed, DEDUP_SECONDS)
            await self._dedup.release(unpublished, token)
        except Exception as exc:
            # Published but not marked: a redelivery within the visibility
            # timeout finds our claim (BUSY), after it the claim lapsed. The
            # delete below makes a redelivery unlikely.
            self._counts.errors.inc()
            log.warning("%s: could not mark messages delivered: %s", self.NAME, exc)
        steps.done("mark")
        await self._delete(done)
        if later:
            await self._hand_back(later, BUSY_RETRY_SECONDS if ok else None)
        steps.done("delete")
        if steps.total > SLOW_BATCH_SECONDS:
            log.warning("%s: a batch of %d took %s", self.NAME, len(batch), steps.describe(batch))
        return ok

    async def _delete(self, messages: Sequence[_Received]) -> None:
        """DeleteMessageBatch, retried; a message left behind comes back and reads done."""
        pending = list(messages)
        if not pending:
            return
        retrying = DELETE_BACKOFF.start()
        while True:
            entries = [{"Id": str(i), "ReceiptHandle": m.receipt} for i, m in enumerate(pending)]
            try:
                response = await self._client.delete_message_batch(
                    QueueUrl=self.queue_url, Entries=entries
                )
            except Exception as exc:
                self._counts.errors.inc()
                reason = str(exc)
            else:
                failed = {entry["Id"] for entry in response.get("Failed", [])}
                pending = [m for i, m in enumerate(pending) if str(i) in failed]
                reason = f"{len(failed)} entries failed"
                if not pending:
                    return
            if not await retrying.wait():
                break
        log.warning(
            "%s: %d delivered messages not deleted (%s); they will come back "
            "and be deleted as duplicates",
            self.NAME,
            len(pending),
            reason,
        )

    async def _hand_back(self, messages: Sequence[_Received], seconds: int | None) -> None:
        """Make unpublished messages visible again soon, rather than after the timeout."""
        self._counts.handed_back.inc(len(messages))
        delay = seconds if seconds is not None else max(1, round(BACKOFF.delay(3)))
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
            self._counts.errors.inc()
            log.warning("%s: could not hand %d messages back: %s", self.NAME, len(messages), exc)


class _Steps:
    """Where one batch's time went, for the log line of a slow one."""

    def __init__(self) -> None:
        self._start = self._last = time.monotonic()
        self._steps: list[tuple[str, float]] = []

    def done(self, step: str) -> None:
        now = time.monotonic()
        self._steps.append((step, now - self._last))
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self._start

    def describe(self, batch: Sequence[_Received]) -> str:
        parts = ", ".join(f"{step} {seconds * 1000:.0f}" for step, seconds in self._steps)
        text = f"{self.total * 1000:.0f} ms ({parts})"
        sent = [m.sent_ms for m in batch if m.sent_ms is not None]
        if sent:
            queued = time.time() * 1000 - min(sent) - self.total * 1000
            text += f"; its oldest message was queued {queued:.0f} ms before"
        return text


def sqs_client(region: str, endpoint_url: str | None, wait_seconds: int, pool: int) -> Any:
    """An aioboto3 SQS client (an async context manager) for long polls of ``wait_seconds``."""
    config = client_config(
        connect_timeout=2,
        read_timeout=wait_seconds + 10,  # a long poll holds the request for up to wait s
        retries={"mode": "standard", "total_max_attempts": 1},  # our loop retries
        max_pool_connections=pool,
    )
    return aioboto3.Session().client(
        "sqs", region_name=region, endpoint_url=endpoint_url, config=config
    )
