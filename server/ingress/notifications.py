"""Notification push: every new ``NOTIFICATION#<userid>`` row reaches that user live.

Many Lambdas and crons write notification rows straight into the table, and the
site shows them only on the next dashboard load. With
``--notifications-from-stream`` one node at a time reads the table's stream
(``server/ingress/table_stream.py``) and turns each INSERT of such a row into a
``notification`` user event ``{"sk", "body"}`` on that user's stream: live on
every open tab, recoverable after a reconnect. The backend changes nothing.

Publishing is idempotent per record: each record's ``eventID`` is claimed in the
dedup store before it is published and marked done after, so a batch read again
after a crash or a lease handover (published, not yet checkpointed) is not
pushed twice. Beneath that, the append names the event by the row's ``sk``
(``<epochMs>#<random>``), so a reader killed between publishing and marking done
still appends it once: the next reader finds the record claimed by the lost one,
publishes it again at once (waiting the claim out would hold every later record
of the shard back a whole ``CLAIM_SECONDS``), and the append absorbs the repeat.

Why the ``sk`` and not the ``eventID``: both are the same in every redelivery
of one stream record (a re-read after a crash or a handover), so either stops
that duplicate. The ``sk`` is the notification's own identity, though: unique
within the user's partition, which is exactly the scope of the id (one user
stream), always present (a row without one is not pushed, while ``eventID`` is
optional here), and what clients see and dismiss by (``payload.sk``). The
``eventID`` names a stream record: the same row put again after a delete is a
new record, and would be pushed again.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from boto3.dynamodb.types import TypeDeserializer

from protocol.errors import ProtocolError
from protocol.parse import parse_broadcast
from server.bus.streams import NOTIFICATION_NAME
from server.coordination.dedup import Claim, Dedup
from server.coordination.lease import Lease
from server.ingress.table_stream import Record, TableStreamReader
from server.runtime.metrics import Registry
from server.services import Publish
from server.store.base import Store

log = logging.getLogger(__name__)

NOTIFICATION_PREFIX = "NOTIFICATION#"
LEASE_KEY = "ap:{notifications}:leader"
"""One reader in the cluster: the node holding this lease (its fence is in the table)."""
DEDUP_PREFIX = "ap:notif:"
DEDUP_SECONDS = 86_400.0
"""A stream keeps records for 24 h: no reader can meet a record again after that."""
CLAIM_SECONDS = 60.0


class _PushCounters:
    """The push's counters, on its node's registry."""

    def __init__(self, registry: Registry) -> None:
        self.pushed = registry.counter(
            "ap_notifications_pushed_total", "Notification rows pushed to users"
        )
        self.repeated = registry.counter(
            "ap_notifications_repeated_total",
            "Notification records read again and not pushed again",
        )
        self.taken_over = registry.counter(
            "ap_notifications_taken_over_total",
            "Records claimed by a reader that lost the lease mid-batch, published again (named)",
        )
        self.unpushable = registry.counter(
            "ap_notifications_unpushable_total", "Notification rows that could not become an event"
        )


_deserializer = TypeDeserializer()


@dataclass(frozen=True, slots=True)
class NewNotification:
    event_id: str
    user_id: str
    sk: str
    body: Any


def _plain(value: Any) -> Any:
    """A deserialized DynamoDB value as JSON: numbers as int or float, sets as lists."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, dict):
        return {key: _plain(inner) for key, inner in value.items()}
    if isinstance(value, list | set | frozenset | tuple):
        return [_plain(inner) for inner in value]
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", "replace")
    return value


def notification_of(record: Record) -> NewNotification | None:
    """The new notification in a stream record, or None for anything else (cheaply)."""
    if record.get("eventName") != "INSERT":
        return None
    change = record.get("dynamodb", {})
    pk = change.get("Keys", {}).get("pk", {}).get("S", "")
    if not pk.startswith(NOTIFICATION_PREFIX):
        return None
    user_id = pk[len(NOTIFICATION_PREFIX) :]
    sk = change.get("Keys", {}).get("sk", {}).get("S")
    image = change.get("NewImage", {})
    if not user_id or not isinstance(sk, str) or "body" not in image:
        return None
    body = _plain(_deserializer.deserialize(image["body"]))
    return NewNotification(str(record.get("eventID", "")), user_id, sk, body)


class NotificationPush:
    """The service: the stream reader, and what it does with each batch."""

    def __init__(
        self,
        publish: Publish,
        store: Store,
        lease: Lease,
        dedup: Dedup,
        *,
        node_id: str,
        table: str,
        region: str,
        endpoint_url: str | None,
        poll_seconds: float,
        metrics: Registry,
    ) -> None:
        self._publish_event = publish
        self._counts = _PushCounters(metrics)
        self._dedup = dedup
        self._token = f"{node_id}/{uuid.uuid4().hex}"
        self._calls = 0
        self.reader = TableStreamReader(
            store,
            lease,
            self.handle,
            table=table,
            region=region,
            endpoint_url=endpoint_url,
            poll_seconds=poll_seconds,
            metrics=metrics,
        )

    async def start(self) -> None:
        await self.reader.start()

    async def stop(self) -> None:
        await self.reader.stop()
        await self._dedup.close()

    async def handle(self, records: Sequence[Record]) -> int:
        """Push the batch's new notifications; raise (the batch comes again) on failure."""
        found = [n for n in map(notification_of, records) if n is not None]
        if not found:
            return 0
        keys = [DEDUP_PREFIX + (n.event_id or f"{n.user_id}#{n.sk}") for n in found]
        # A token per call: two deliveries of one record must never both hold the claim.
        self._calls += 1
        token = f"{self._token}/{self._calls}"
        claims = await self._dedup.claim(keys, token, CLAIM_SECONDS)
        done: list[str] = []
        try:
            for notification, key, claim in zip(found, keys, claims, strict=True):
                if claim is Claim.DONE:
                    self._counts.repeated.inc()
                    continue
                if claim is Claim.BUSY:
                    # Claimed by a reader that lost the lease mid-batch (killed,
                    # paused): this one holds it now, and the append is named.
                    self._counts.taken_over.inc()
                    log.info(
                        "record %s was claimed by an earlier reader; publishing it again",
                        notification.event_id,
                    )
                await self._publish(notification)
                done.append(key)
        except BaseException:
            await self._dedup.complete(done, DEDUP_SECONDS)
            await self._dedup.release([k for k in keys if k not in done], token)
            raise
        await self._dedup.complete(done, DEDUP_SECONDS)
        return len(found)

    async def _publish(self, notification: NewNotification) -> None:
        body = {
            "verb": "notification",
            "payload": {"sk": notification.sk, "body": notification.body},
            "users": [notification.user_id],
        }
        try:
            message = parse_broadcast(json.dumps(body))
        except (ProtocolError, TypeError, ValueError) as exc:
            # Retrying cannot fix it: count it and move on, as with a poison message.
            self._counts.unpushable.inc()
            reason = exc.message if isinstance(exc, ProtocolError) else str(exc)
            log.warning(
                "notification %s for %s not pushed: %s",
                notification.sk,
                notification.user_id,
                reason,
            )
            return
        # Named as long as the dedup above remembers the record (24 h).
        name = NOTIFICATION_NAME + notification.sk
        await self._publish_event(message, require_cluster=True, event_id=name)
        self._counts.pushed.inc()
