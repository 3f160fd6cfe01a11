"""DynamoDB store: connection rows and the presence counter in Abstract Play's table.

Uses the aioboto3 low-level client. botocore's own retries are switched off so
that every retry goes through one loop here, with jittered exponential backoff,
a log line and a metric; after a bounded number of attempts the call raises
StoreUnavailable. Errors that retrying cannot fix (validation, missing table,
bad credentials) raise StoreUnavailable at once. The access patterns, and why
each has its shape, are in ``docs/access-patterns.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import replace
from typing import Any

import aioboto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from server.aws import client_config
from server.runtime.backoff import Backoff
from server.runtime.metrics import Registry
from server.store import keys
from server.store.base import (
    STREAM_CHECKPOINT_TTL_SECONDS,
    BotRecord,
    ConnectionRecord,
    CurrentGame,
    Fenced,
    ShardCheckpoint,
    StoreUnavailable,
    StreamReaderState,
)
from server.store.dynamodb_records import GameRecordsMixin

log = logging.getLogger(__name__)

BATCH_WRITE_LIMIT = 25
"""BatchWriteItem takes at most 25 put/delete requests."""

WRITE_CONCURRENCY = 8
"""BatchWriteItem calls in flight at once for one ``write_connections``."""

MAX_ATTEMPTS = 8
"""Attempts per request (and rounds without progress for unprocessed items)."""

START_ATTEMPTS = 2
"""Attempts of the reachability check in ``start()``: a wrong endpoint fails fast."""

BACKOFF = Backoff(first=0.05, cap=2.0)
"""Between two attempts of one request (or two rounds of unprocessed items)."""

CONNECT_TIMEOUT_SECONDS = 2.0
READ_TIMEOUT_SECONDS = 5.0

THROTTLE_CODES = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
    }
)
TRANSIENT_CODES = THROTTLE_CODES | frozenset(
    {
        "InternalServerError",
        "InternalFailure",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "LimitExceededException",
    }
)
CONDITIONAL_CHECK_FAILED = "ConditionalCheckFailedException"
RESOURCE_NOT_FOUND = "ResourceNotFoundException"
RESOURCE_IN_USE = "ResourceInUseException"


class StoreCounters:
    """What the retry loop counts, on a registry (the node's, when wiring built the store)."""

    def __init__(self, registry: Registry) -> None:
        self.retries = registry.counter(
            "ap_dynamodb_retries_total", "DynamoDB requests retried after a transient error."
        )
        self.throttles = registry.counter(
            "ap_dynamodb_throttles_total",
            "DynamoDB requests refused for throttling (then retried).",
        )
        self.unprocessed = registry.counter(
            "ap_dynamodb_unprocessed_items_total",
            "Items a BatchWriteItem returned unprocessed (then written again).",
        )
        self.failures = registry.counter(
            "ap_dynamodb_failures_total", "DynamoDB requests given up on (raised StoreUnavailable)."
        )


_CONNECTIONS_PK_VALUE: dict[str, Any] = {":pk": {"S": keys.CONNECTIONS_PK}}


def _client_config() -> Config:
    return client_config(
        connect_timeout=CONNECT_TIMEOUT_SECONDS,
        read_timeout=READ_TIMEOUT_SECONDS,
        retries={"mode": "standard", "total_max_attempts": 1},
        max_pool_connections=WRITE_CONCURRENCY * 2,
    )


def _where(endpoint_url: str | None, region: str) -> str:
    return endpoint_url if endpoint_url else f"AWS DynamoDB in {region}"


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _error_message(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", "")) or str(exc)


def _is_transient(exc: ClientError) -> bool:
    if error_code(exc) in TRANSIENT_CODES:
        return True
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return isinstance(status, int) and status >= 500


async def call_with_retry(
    client: Any,
    operation: str,
    *,
    where: str,
    table: str,
    counters: StoreCounters,
    attempts: int = MAX_ATTEMPTS,
    passthrough: frozenset[str] = frozenset(),
    **params: Any,
) -> dict[str, Any]:
    """Call ``client.<operation>(**params)``, retrying transient errors.

    A ClientError whose code is in ``passthrough`` is re-raised untouched for the
    caller to handle; every other failure becomes StoreUnavailable.
    """
    method = getattr(client, operation)
    retrying = replace(BACKOFF, attempts=attempts).start()
    while True:
        try:
            response: dict[str, Any] = await method(**params)
            return response
        except ClientError as exc:
            code = error_code(exc)
            if code in passthrough:
                raise
            if not _is_transient(exc):
                counters.failures.inc()
                raise StoreUnavailable(
                    f"DynamoDB {operation} on table {table!r} at {where} failed: "
                    f"{code}: {_error_message(exc)}"
                ) from exc
            if code in THROTTLE_CODES:
                counters.throttles.inc()
            reason = f"{code}: {_error_message(exc)}"
            last: Exception = exc
        except (BotoConnectionError, HTTPClientError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            last = exc
        except BotoCoreError as exc:
            counters.failures.inc()
            raise StoreUnavailable(
                f"DynamoDB {operation} on table {table!r} at {where} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        delay = retrying.next_delay()
        if delay is None:
            counters.failures.inc()
            raise StoreUnavailable(
                f"DynamoDB {operation} on table {table!r} at {where} failed after "
                f"{attempts} attempts: {reason}"
            ) from last
        counters.retries.inc()
        log.warning(
            "DynamoDB %s on %r at %s: %s; retry %d/%d in %.2fs",
            operation,
            table,
            where,
            reason,
            retrying.failures,
            attempts - 1,
            delay,
        )
        await asyncio.sleep(delay)


def _chunks(items: Sequence[dict[str, Any]], size: int) -> Iterable[list[dict[str, Any]]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


class DynamoStore(GameRecordsMixin):
    """The Store protocol on a DynamoDB table with string ``pk``/``sk`` keys."""

    def __init__(
        self,
        table: str = "abstract-play-dev",
        region: str = "us-east-1",
        endpoint_url: str | None = None,
        *,
        max_attempts: int = MAX_ATTEMPTS,
        metrics: Registry | None = None,
    ) -> None:
        self.metrics = metrics or Registry()
        self._counters = StoreCounters(self.metrics)
        self.table = table
        self.region = region
        self.endpoint_url = endpoint_url
        self._max_attempts = max_attempts
        self._where = _where(endpoint_url, region)
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the client and check the table with DescribeTable."""
        if self._client is not None:
            return
        stack = contextlib.AsyncExitStack()
        try:
            session = aioboto3.Session()
            client = await stack.enter_async_context(
                session.client(
                    "dynamodb",
                    endpoint_url=self.endpoint_url,
                    region_name=self.region,
                    config=_client_config(),
                )
            )
            await self._check_table(client)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        self._client = client

    async def _check_table(self, client: Any) -> None:
        try:
            response = await call_with_retry(
                client,
                "describe_table",
                where=self._where,
                table=self.table,
                counters=self._counters,
                attempts=START_ATTEMPTS,
                passthrough=frozenset({RESOURCE_NOT_FOUND}),
                TableName=self.table,
            )
        except ClientError as exc:
            raise StoreUnavailable(
                f"DynamoDB table {self.table!r} does not exist at {self._where} "
                f"(create it with `ap-realtime create-table`)"
            ) from exc
        except StoreUnavailable as exc:
            raise StoreUnavailable(
                f"cannot reach DynamoDB table {self.table!r} at {self._where}: {exc}"
            ) from exc
        description = response.get("Table", {})
        _check_description(description, self.table, self._where)

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    def _require_client(self) -> Any:
        if self._client is None:
            raise StoreUnavailable("DynamoStore used before start() or after close()")
        return self._client

    async def _call(
        self, operation: str, *, passthrough: frozenset[str] = frozenset(), **params: Any
    ) -> dict[str, Any]:
        return await call_with_retry(
            self._require_client(),
            operation,
            where=self._where,
            table=self.table,
            counters=self._counters,
            attempts=self._max_attempts,
            passthrough=passthrough,
            **params,
        )

    # -------------------------------------------------------------------- writes

    async def write_connections(
        self, puts: Sequence[ConnectionRecord], deletes: Sequence[str]
    ) -> None:
        # Keyed by connection id: one request per key, as BatchWriteItem demands
        # (a delete after a put of the same id wins, as in the memory store).
        requests: dict[str, dict[str, Any]] = {}
        for record in puts:
            requests[record.connection_id] = {"PutRequest": {"Item": keys.to_item(record)}}
        for connection_id in deletes:
            requests[connection_id] = {"DeleteRequest": {"Key": keys.connection_key(connection_id)}}
        await self._batch_write(list(requests.values()))

    async def _batch_write(self, requests: Sequence[dict[str, Any]]) -> None:
        if not requests:
            return
        chunks = list(_chunks(requests, BATCH_WRITE_LIMIT))
        if len(chunks) == 1:
            await self._write_chunk(chunks[0])
            return
        limit = asyncio.Semaphore(WRITE_CONCURRENCY)

        async def write(chunk: list[dict[str, Any]]) -> None:
            async with limit:
                await self._write_chunk(chunk)

        try:
            async with asyncio.TaskGroup() as group:
                for chunk in chunks:
                    group.create_task(write(chunk))
        except ExceptionGroup as group_error:
            first = group_error.exceptions[0]
            if isinstance(first, StoreUnavailable):
                raise first from group_error
            raise

    async def _write_chunk(self, chunk: list[dict[str, Any]]) -> None:
        """One BatchWriteItem, then its UnprocessedItems again until none are left."""
        pending = chunk
        stalled = replace(BACKOFF, attempts=self._max_attempts).start()
        while pending:
            response = await self._call("batch_write_item", RequestItems={self.table: pending})
            unprocessed: list[dict[str, Any]] = response.get("UnprocessedItems", {}).get(
                self.table, []
            )
            if not unprocessed:
                return
            self._counters.unprocessed.inc(len(unprocessed))
            if len(unprocessed) < len(pending):
                stalled.reset()  # progress: only rounds without any count
            delay = stalled.next_delay()
            if delay is None:
                self._counters.failures.inc()
                raise StoreUnavailable(
                    f"DynamoDB batch_write_item on table {self.table!r} at {self._where}: "
                    f"{len(unprocessed)} items still unprocessed after {stalled.failures} rounds"
                )
            self._counters.retries.inc()
            log.warning(
                "DynamoDB batch_write_item on %r: %d of %d items unprocessed; retry in %.2fs",
                self.table,
                len(unprocessed),
                len(pending),
                delay,
            )
            await asyncio.sleep(delay)
            pending = unprocessed

    async def _update_if_exists(self, connection_id: str, **params: Any) -> None:
        """UpdateItem on a connection row that must already exist; else a no-op."""
        names: dict[str, str] = params.pop("ExpressionAttributeNames", {})
        try:
            await self._call(
                "update_item",
                passthrough=frozenset({CONDITIONAL_CHECK_FAILED}),
                TableName=self.table,
                Key=keys.connection_key(connection_id),
                ConditionExpression="attribute_exists(#pk)",
                ExpressionAttributeNames={"#pk": keys.PK, **names},
                **params,
            )
        except ClientError as exc:
            if error_code(exc) != CONDITIONAL_CHECK_FAILED:
                raise
            # The row is gone (closed, or deleted by the node): never resurrect it.

    async def update_watch(
        self, connection_id: str, games: frozenset[str], watch_version: int, ttl: int
    ) -> None:
        names = {"#wv": keys.WATCH_VERSION, "#ttl": keys.TTL, "#wg": keys.WATCHING_GAMES}
        values: dict[str, Any] = {":wv": keys.number(watch_version), ":ttl": keys.number(ttl)}
        if games:
            values[":wg"] = keys.string_set(games)
            expression = "SET #wv = :wv, #ttl = :ttl, #wg = :wg"
        else:
            expression = "SET #wv = :wv, #ttl = :ttl REMOVE #wg"
        await self._update_if_exists(
            connection_id,
            UpdateExpression=expression,
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=values,
        )

    async def refresh_ttl(self, connection_id: str, ttl: int) -> None:
        await self._update_if_exists(
            connection_id,
            UpdateExpression="SET #ttl = :ttl",
            ExpressionAttributeNames={"#ttl": keys.TTL},
            ExpressionAttributeValues={":ttl": keys.number(ttl)},
        )

    # --------------------------------------------------------------------- reads

    async def get_connection(self, connection_id: str) -> ConnectionRecord | None:
        response = await self._call(
            "get_item",
            TableName=self.table,
            Key=keys.connection_key(connection_id),
            ConsistentRead=True,
        )
        item = response.get("Item")
        if not item:
            return None
        record = self._parse(item)
        if record is None or record.ttl <= time.time():
            return None
        return record

    async def list_connections(self) -> list[ConnectionRecord]:
        now = time.time()
        records: list[ConnectionRecord] = []
        async for item in self._query_connections():
            record = self._parse(item)
            if record is not None and record.ttl > now:
                records.append(record)
        return records

    def _parse(self, item: keys.Item) -> ConnectionRecord | None:
        try:
            return keys.from_item(item)
        except ValueError:
            log.warning("skipping malformed wsConnections row in %r: %r", self.table, item)
            return None

    async def _query_connections(self, **extra: Any) -> AsyncIterator[keys.Item]:
        """Every ``pk=wsConnections`` item, page by page."""
        names: dict[str, str] = {"#pk": keys.PK, **extra.pop("ExpressionAttributeNames", {})}
        values: dict[str, Any] = {
            **_CONNECTIONS_PK_VALUE,
            **extra.pop("ExpressionAttributeValues", {}),
        }
        params: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "#pk = :pk",
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
            "ConsistentRead": True,
            **extra,
        }
        while True:
            response = await self._call("query", **params)
            for item in response.get("Items", []):
                yield item
            last_key = response.get("LastEvaluatedKey")
            if not last_key:
                return
            params["ExclusiveStartKey"] = last_key

    async def delete_endpoint_connections(self, endpoint: str) -> int:
        connection_ids: list[str] = []
        async for item in self._query_connections(
            FilterExpression="#ep = :ep",
            ProjectionExpression="#sk",
            ExpressionAttributeNames={"#ep": keys.ENDPOINT, "#sk": keys.SK},
            ExpressionAttributeValues={":ep": {"S": endpoint}},
        ):
            connection_ids.append(item[keys.SK]["S"])
        await self._batch_write(
            [{"DeleteRequest": {"Key": keys.connection_key(cid)}} for cid in connection_ids]
        )
        if connection_ids:
            log.info(
                "deleted %d wsConnections rows of endpoint %s from %r",
                len(connection_ids),
                endpoint,
                self.table,
            )
        return len(connection_ids)

    # ------------------------------------------------------------ presence counter

    async def reserve_presence_seq(self, seq: int) -> int:
        # A conditional SET, not ADD: a retry of a write that applied (a read
        # timeout, a lost answer) finds the condition false and changes nothing,
        # where ADD would add twice and the writer would skip a number.
        try:
            await self._call(
                "update_item",
                passthrough=frozenset({"ConditionalCheckFailedException"}),
                TableName=self.table,
                Key=keys.presence_seq_key(),
                UpdateExpression="SET #seq = :seq",
                ConditionExpression="attribute_not_exists(#seq) OR #seq < :seq",
                ExpressionAttributeNames={"#seq": keys.SEQ},
                ExpressionAttributeValues={":seq": keys.number(seq)},
            )
        except ClientError:  # already there or beyond: the value it holds
            held = await self.current_presence_seq()
            if held < seq:
                raise StoreUnavailable(
                    f"DynamoDB {keys.META_PK}/{keys.PRESENCE_SEQ_SK} in table {self.table!r} "
                    f"refused seq {seq} but holds {held}"
                ) from None
            return held
        return seq

    async def current_presence_seq(self) -> int:
        response = await self._call(
            "get_item",
            TableName=self.table,
            Key=keys.presence_seq_key(),
            ConsistentRead=True,
            ProjectionExpression="#seq",
            ExpressionAttributeNames={"#seq": keys.SEQ},
        )
        return keys.parse_int(response.get("Item", {}).get(keys.SEQ)) or 0

    # ------------------------------------------------------- stream reader records

    async def take_stream_fence(self, stream_arn: str, now_ms: int) -> StreamReaderState:
        names = {"#arn": keys.STREAM_ARN, "#st": keys.STARTED_AT, "#fence": keys.FENCE}
        values: dict[str, Any] = {
            ":arn": {"S": stream_arn},
            ":now": keys.number(now_ms),
            ":one": keys.number(1),
        }
        try:
            response = await self._call(
                "update_item",
                passthrough=frozenset({CONDITIONAL_CHECK_FAILED}),
                TableName=self.table,
                Key=keys.notification_stream_key(),
                UpdateExpression="SET #arn = :arn, #st = if_not_exists(#st, :now) ADD #fence :one",
                ConditionExpression="attribute_not_exists(#arn) OR #arn = :arn",
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
                ReturnValues="ALL_NEW",
            )
        except ClientError as exc:
            if error_code(exc) != CONDITIONAL_CHECK_FAILED:
                raise
            # The stream was re-created (a new ARN): a first start on it.
            response = await self._call(
                "update_item",
                TableName=self.table,
                Key=keys.notification_stream_key(),
                UpdateExpression="SET #arn = :arn, #st = :now ADD #fence :one",
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
                ReturnValues="ALL_NEW",
            )
        attributes = response.get("Attributes", {})
        fence = keys.parse_int(attributes.get(keys.FENCE))
        started = keys.parse_int(attributes.get(keys.STARTED_AT))
        if fence is None or started is None:
            raise StoreUnavailable(
                f"DynamoDB update_item on {keys.META_PK}/{keys.NOTIFICATION_STREAM_SK} in "
                f"table {self.table!r} returned {attributes!r}"
            )
        return StreamReaderState(fence=fence, started_at_ms=started, fresh=started == now_ms)

    async def stream_checkpoints(self, stream_arn: str) -> dict[str, ShardCheckpoint]:
        params: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "#pk = :pk AND begins_with(#sk, :prefix)",
            "ExpressionAttributeNames": {"#pk": keys.PK, "#sk": keys.SK},
            "ExpressionAttributeValues": {
                ":pk": {"S": keys.META_PK},
                ":prefix": {"S": keys.STREAM_SHARD_SK_PREFIX},
            },
            "ConsistentRead": True,
        }
        found: dict[str, ShardCheckpoint] = {}
        while True:
            response = await self._call("query", **params)
            for item in response.get("Items", []):
                if item.get(keys.STREAM_ARN, {}).get("S") != stream_arn:
                    continue  # a checkpoint of an earlier stream of this table
                shard_id = item[keys.SK]["S"][len(keys.STREAM_SHARD_SK_PREFIX) :]
                sequence = item.get(keys.SEQUENCE_NUMBER, {}).get("S")
                done = bool(item.get(keys.DONE, {}).get("BOOL", False))
                found[shard_id] = ShardCheckpoint(shard_id, sequence, done)
            last_key = response.get("LastEvaluatedKey")
            if not last_key:
                return found
            params["ExclusiveStartKey"] = last_key

    async def save_stream_checkpoint(
        self, stream_arn: str, checkpoint: ShardCheckpoint, fence: int
    ) -> None:
        item: keys.Item = {
            **keys.stream_shard_key(checkpoint.shard_id),
            keys.STREAM_ARN: {"S": stream_arn},
            keys.SHARD_ID: {"S": checkpoint.shard_id},
            keys.DONE: {"BOOL": checkpoint.done},
            keys.FENCE: keys.number(fence),
            keys.TTL: keys.number(int(time.time()) + STREAM_CHECKPOINT_TTL_SECONDS),
        }
        if checkpoint.sequence_number is not None:
            item[keys.SEQUENCE_NUMBER] = {"S": checkpoint.sequence_number}
        try:
            await self._call(
                "put_item",
                passthrough=frozenset({CONDITIONAL_CHECK_FAILED}),
                TableName=self.table,
                Item=item,
                ConditionExpression="attribute_not_exists(#fence) OR #fence <= :fence",
                ExpressionAttributeNames={"#fence": keys.FENCE},
                ExpressionAttributeValues={":fence": keys.number(fence)},
            )
        except ClientError as exc:
            if error_code(exc) != CONDITIONAL_CHECK_FAILED:
                raise
            raise Fenced(
                f"shard {checkpoint.shard_id} was checkpointed by a reader with a fence "
                f"above {fence}"
            ) from exc

    # ------------------------------------------------- the backend's rows (read only)

    async def get_bot(self, client_id: str) -> BotRecord | None:
        # Eventually consistent: BOT rows change only when an owner edits a bot.
        response = await self._call(
            "get_item",
            TableName=self.table,
            Key=keys.bot_key(client_id),
            ProjectionExpression="#sk, #name, #owner",
            ExpressionAttributeNames={
                "#sk": keys.SK,
                "#name": keys.BOT_NAME,
                "#owner": keys.BOT_OWNER,
            },
        )
        item = response.get("Item")
        return keys.bot_from_item(item) if item else None

    async def current_games(self, user_id: str) -> list[CurrentGame]:
        params: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "#pk = :pk",
            # Only what routing needs: a game's summary row also carries clocks,
            # variants and player names.
            "ProjectionExpression": "#sk, #id, #meta, #players, #toMove",
            "ExpressionAttributeNames": {
                "#pk": keys.PK,
                "#sk": keys.SK,
                "#id": keys.GAME_ID,
                "#meta": keys.META_GAME,
                "#players": keys.PLAYERS,
                "#toMove": keys.TO_MOVE,
            },
            "ExpressionAttributeValues": {":pk": {"S": keys.current_games_pk(user_id)}},
        }
        games: list[CurrentGame] = []
        while True:
            response = await self._call("query", **params)
            for item in response.get("Items", []):
                game = keys.current_game_from_item(item)
                if game is None:
                    log.warning("skipping malformed CURRENTGAMES# row in %r: %r", self.table, item)
                else:
                    games.append(game)
            last_key = response.get("LastEvaluatedKey")
            if not last_key:
                return games
            params["ExclusiveStartKey"] = last_key


def _check_description(description: dict[str, Any], table: str, where: str) -> None:
    """Raise StoreUnavailable unless the table is usable and keyed ``pk``/``sk``."""
    status = description.get("TableStatus")
    if status not in ("ACTIVE", "UPDATING"):
        raise StoreUnavailable(f"DynamoDB table {table!r} at {where} is {status}, not ACTIVE")
    schema = {k.get("AttributeName"): k.get("KeyType") for k in description.get("KeySchema", [])}
    if schema != {keys.PK: "HASH", keys.SK: "RANGE"}:
        raise StoreUnavailable(
            f"DynamoDB table {table!r} at {where} has key schema {schema}; "
            f"expected pk (HASH) and sk (RANGE)"
        )


# ----------------------------------------------------------------------- table setup

TABLE_WAIT_DELAY_SECONDS = 1
TABLE_WAIT_MAX_ATTEMPTS = 120

KEY_SCHEMA = [
    {"AttributeName": keys.PK, "KeyType": "HASH"},
    {"AttributeName": keys.SK, "KeyType": "RANGE"},
]
"""The table's key, as CreateTable takes it: string ``pk`` and ``sk``."""
KEY_ATTRIBUTES = [
    {"AttributeName": keys.PK, "AttributeType": "S"},
    {"AttributeName": keys.SK, "AttributeType": "S"},
]


async def create_table(
    endpoint_url: str | None, table: str = "abstract-play-dev", region: str = "us-east-1"
) -> None:
    """Create the table (pk/sk strings, on demand) and enable TTL on ``ttl``.

    Idempotent: an existing table is kept (its key schema is checked) and TTL is
    still ensured. Raises StoreUnavailable when DynamoDB cannot be reached or
    refuses, or when TTL is already enabled on another attribute.
    """
    where = _where(endpoint_url, region)
    counters = StoreCounters(Registry())  # a command of its own, outside any node
    session = aioboto3.Session()
    async with session.client(
        "dynamodb", endpoint_url=endpoint_url, region_name=region, config=_client_config()
    ) as client:
        try:
            await call_with_retry(
                client,
                "create_table",
                where=where,
                table=table,
                counters=counters,
                passthrough=frozenset({RESOURCE_IN_USE}),
                TableName=table,
                AttributeDefinitions=KEY_ATTRIBUTES,
                KeySchema=KEY_SCHEMA,
                BillingMode="PAY_PER_REQUEST",
            )
            log.info("created DynamoDB table %r at %s", table, where)
        except ClientError:
            log.info("DynamoDB table %r already exists at %s", table, where)

        waiter = client.get_waiter("table_exists")
        try:
            await waiter.wait(
                TableName=table,
                WaiterConfig={
                    "Delay": TABLE_WAIT_DELAY_SECONDS,
                    "MaxAttempts": TABLE_WAIT_MAX_ATTEMPTS,
                },
            )
        except BotoCoreError as exc:  # WaiterError
            raise StoreUnavailable(
                f"DynamoDB table {table!r} at {where} did not become ACTIVE: {exc}"
            ) from exc
        described = await call_with_retry(
            client, "describe_table", where=where, table=table, counters=counters, TableName=table
        )
        _check_description(described.get("Table", {}), table, where)

        ttl = await call_with_retry(
            client,
            "describe_time_to_live",
            where=where,
            table=table,
            counters=counters,
            TableName=table,
        )
        ttl_description = ttl.get("TimeToLiveDescription", {})
        status = ttl_description.get("TimeToLiveStatus", "DISABLED")
        attribute = ttl_description.get("AttributeName")
        if status in ("ENABLED", "ENABLING"):
            if attribute != keys.TTL:
                raise StoreUnavailable(
                    f"DynamoDB table {table!r} at {where} has TTL on {attribute!r}, "
                    f"not {keys.TTL!r}; connection rows would never expire"
                )
            return
        await call_with_retry(
            client,
            "update_time_to_live",
            where=where,
            table=table,
            counters=counters,
            TableName=table,
            TimeToLiveSpecification={"Enabled": True, "AttributeName": keys.TTL},
        )
        log.info("enabled TTL on attribute %r of DynamoDB table %r", keys.TTL, table)
