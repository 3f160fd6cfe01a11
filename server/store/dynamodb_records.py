"""The game-side access patterns of :class:`~server.store.dynamodb.DynamoStore`.

Each method is one pattern of ``docs/access-patterns.md`` (chat append, GAME
projection, USER.admin, GAMEWATCHERS#, USERGAME#, WATCHED#, USERS.lastSeen).
Requests go through the store's ``_call``: the same retries, metrics and errors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from botocore.exceptions import ClientError

from protocol.chat import COMMENTS_CAP_BYTES, comment_weight
from server.runtime.backoff import Backoff
from server.store import records as r
from server.store.base import (
    BOT_CANDIDATE_TTL_SECONDS,
    BotCandidate,
    CurrentGame,
    StoreUnavailable,
)
from server.store.keys import (
    AttributeValue,
    Item,
    current_game_from_item,
    number,
    parse_int,
)
from server.store.records import AppendOutcome, AppendStatus, GameAccess, GameStatus, StoredComment

log = logging.getLogger(__name__)

CONDITIONAL_CHECK_FAILED = "ConditionalCheckFailedException"
_CCF = frozenset({CONDITIONAL_CHECK_FAILED})

APPEND_ROUNDS = 8
"""Conditional attempts of one append; each lost race means another writer made progress."""

APPEND_BATCH_MAX = 40
"""Comments in one UpdateItem: each adds about 50 characters to the update and the
condition expressions, which DynamoDB caps at 4 KB each."""

MARK_CONCURRENCY = 8

LAST_SEEN_STATEMENTS = 25
"""``lastSeen`` updates in one ``BatchExecuteStatement``: its limit."""
RETRYABLE_STATEMENT_ERRORS = frozenset(
    {
        "InternalServerError",
        "ProvisionedThroughputExceeded",
        "RequestLimitExceeded",
        "ThrottlingError",
        "TransactionConflict",
    }
)
"""A statement's own error codes that mean "send it again", not "not written"."""

UNPROCESSED_KEYS_BACKOFF = Backoff(first=0.05, cap=0.05, jitter=0.0, attempts=8)
"""Rounds for what a batch call left undone under load: BatchGetItem's unprocessed
keys, BatchExecuteStatement's throttled statements."""


def _key(pk: str, sk: str) -> Item:
    return {"pk": {"S": pk}, "sk": {"S": sk}}


def _comment_value(comment: StoredComment) -> dict[str, Any]:
    return {
        "M": {
            r.COMMENT: {"S": comment.comment},
            r.USER_ID: {"S": comment.user_id},
            r.MOVE_NUMBER: number(comment.move_number),
            r.TIME_STAMP: number(comment.time_stamp),
        }
    }


def _is_ccf(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code", "")) == CONDITIONAL_CHECK_FAILED


class GameRecordsMixin:
    """Mixed into DynamoStore, which provides ``table`` and ``_call``."""

    table: str

    async def _call(
        self, operation: str, *, passthrough: frozenset[str] = frozenset(), **params: Any
    ) -> dict[str, Any]:
        raise NotImplementedError

    async def _batch_write(self, requests: Sequence[dict[str, Any]]) -> None:
        raise NotImplementedError

    async def _get(self, pk: str, sk: str, *names: str) -> Item | None:
        """GetItem, consistent, projecting only ``names`` (dotted for map entries)."""
        params: dict[str, Any] = {
            "TableName": self.table,
            "Key": _key(pk, sk),
            "ConsistentRead": True,
        }
        if names:
            aliases: dict[str, str] = {}
            paths: list[str] = []
            for name in names:
                parts = []
                for part in name.split("."):
                    alias = f"#a{len(aliases)}"
                    aliases[alias] = part
                    parts.append(alias)
                paths.append(".".join(parts))
            params["ProjectionExpression"] = ", ".join(paths)
            params["ExpressionAttributeNames"] = aliases
        item: Item | None = (await self._call("get_item", **params)).get("Item")
        return item

    async def _update_ignoring_condition(self, **params: Any) -> bool:
        """UpdateItem whose failed condition means "nothing to do"; True when applied."""
        try:
            await self._call("update_item", passthrough=_CCF, TableName=self.table, **params)
        except ClientError as exc:
            if not _is_ccf(exc):
                raise
            return False
        return True

    # --- authorization --------------------------------------------------------

    async def get_game_access(self, meta: str, game_id: str) -> GameAccess:
        active = await self._get(r.GAME_PK, r.game_sk(meta, game_id, completed=False), r.PLAYERS)
        if active is not None:
            players = active.get(r.PLAYERS, {}).get("L", [])
            ids = tuple(
                p["M"][r.PLAYER_ID]["S"]
                for p in players
                if "M" in p and "S" in p["M"].get(r.PLAYER_ID, {})
            )
            return GameAccess(GameStatus.ACTIVE, ids)
        completed = await self._get(r.GAME_PK, r.game_sk(meta, game_id, completed=True), "pk")
        return GameAccess(GameStatus.COMPLETED if completed is not None else GameStatus.MISSING)

    async def is_admin(self, user_id: str) -> bool:
        user = await self._get(r.USER_PK, user_id, r.ADMIN)
        return user is not None and user.get(r.ADMIN, {}).get("BOOL") is True

    # --- the chat append --------------------------------------------------------

    async def append_comment(self, game_id: str, comment: StoredComment, key: str) -> AppendOutcome:
        weight = comment_weight(comment.comment)
        for _ in range(APPEND_ROUNDS):
            if await self._append_counted(game_id, comment, key, weight):
                return AppendOutcome(AppendStatus.STORED, comment.time_stamp)
            # The condition failed: find out why, with a small projection.
            item = await self._get(
                r.GAMECOMMENTS_PK, game_id, "pk", r.COMMENT_BYTES, f"{r.COMMENT_IDS}.{key}"
            )
            if item is None:
                if await self._append_first(game_id, comment, key, weight):
                    return AppendOutcome(AppendStatus.STORED, comment.time_stamp)
                continue  # someone created it meanwhile
            earlier = parse_int(item.get(r.COMMENT_IDS, {}).get("M", {}).get(key))
            if earlier is not None:
                return AppendOutcome(AppendStatus.DUPLICATE, earlier)
            total = parse_int(item.get(r.COMMENT_BYTES))
            if total is None:
                outcome = await self._append_and_count(game_id, comment, key, weight)
                if outcome is not None:
                    return outcome
                continue
            if total + weight >= COMMENTS_CAP_BYTES:
                return AppendOutcome(AppendStatus.FULL)
        raise StoreUnavailable(
            f"append to {r.GAMECOMMENTS_PK}/{game_id} in {self.table!r} lost "
            f"{APPEND_ROUNDS} races in a row"
        )

    async def append_comments(
        self, game_id: str, entries: Sequence[tuple[StoredComment, str]]
    ) -> list[AppendOutcome]:
        outcomes: list[AppendOutcome] = []
        for start in range(0, len(entries), APPEND_BATCH_MAX):
            chunk = entries[start : start + APPEND_BATCH_MAX]
            distinct = len({key for _, key in chunk}) == len(chunk)
            if len(chunk) > 1 and distinct and await self._append_counted_many(game_id, chunk):
                outcomes += [AppendOutcome(AppendStatus.STORED, c.time_stamp) for c, _ in chunk]
                continue
            # One comment, a key twice, or a condition failed (the first comment, a
            # duplicate, the cap, an item without its counter): one at a time, each
            # with its own answer, exactly as if they had come one by one.
            for comment, key in chunk:
                outcomes.append(await self.append_comment(game_id, comment, key))
        return outcomes

    async def _append_counted_many(
        self, game_id: str, entries: Sequence[tuple[StoredComment, str]]
    ) -> bool:
        """All of ``entries`` in one conditional UpdateItem, when the item has its
        counter, none of the keys is stored and all of them fit under the cap."""
        names = {"#c": r.COMMENTS, "#b": r.COMMENT_BYTES, "#ids": r.COMMENT_IDS}
        values: dict[str, Any] = {
            ":new": {"L": [_comment_value(comment) for comment, _ in entries]},
        }
        sets = ["#c = list_append(#c, :new)"]
        absent = []
        weight = 0
        for index, (comment, key) in enumerate(entries):
            names[f"#k{index}"] = key
            values[f":t{index}"] = number(comment.time_stamp)
            sets.append(f"#ids.#k{index} = :t{index}")
            absent.append(f"attribute_not_exists(#ids.#k{index})")
            weight += comment_weight(comment.comment)
        values[":w"] = number(weight)
        values[":room"] = number(COMMENTS_CAP_BYTES - weight)
        return await self._update_ignoring_condition(
            Key=_key(r.GAMECOMMENTS_PK, game_id),
            UpdateExpression=f"SET {', '.join(sets)} ADD #b :w",
            ConditionExpression=" AND ".join(["#b < :room", *absent]),
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=values,
        )

    async def _append_counted(
        self, game_id: str, comment: StoredComment, key: str, weight: int
    ) -> bool:
        """The usual case: the item has its counter; one conditional UpdateItem."""
        return await self._update_ignoring_condition(
            Key=_key(r.GAMECOMMENTS_PK, game_id),
            UpdateExpression="SET #c = list_append(#c, :new), #ids.#k = :ts ADD #b :w",
            ConditionExpression="#b < :room AND attribute_not_exists(#ids.#k)",
            ExpressionAttributeNames={
                "#c": r.COMMENTS,
                "#b": r.COMMENT_BYTES,
                "#ids": r.COMMENT_IDS,
                "#k": key,
            },
            ExpressionAttributeValues={
                ":new": {"L": [_comment_value(comment)]},
                ":ts": number(comment.time_stamp),
                ":w": number(weight),
                ":room": number(COMMENTS_CAP_BYTES - weight),
            },
        )

    async def _append_first(
        self, game_id: str, comment: StoredComment, key: str, weight: int
    ) -> bool:
        """The game's first comment: create the item, unless it appeared meanwhile."""
        return await self._update_ignoring_condition(
            Key=_key(r.GAMECOMMENTS_PK, game_id),
            UpdateExpression="SET #c = :new, #b = :w, #ids = :ids",
            ConditionExpression="attribute_not_exists(pk)",
            ExpressionAttributeNames={
                "#c": r.COMMENTS,
                "#b": r.COMMENT_BYTES,
                "#ids": r.COMMENT_IDS,
            },
            ExpressionAttributeValues={
                ":new": {"L": [_comment_value(comment)]},
                ":w": number(weight),
                ":ids": {"M": {key: number(comment.time_stamp)}},
            },
        )

    async def _append_and_count(
        self, game_id: str, comment: StoredComment, key: str, weight: int
    ) -> AppendOutcome | None:
        """An item written before the counter existed: count its comments, then append
        on condition that the list is still the one counted. None: it changed, retry."""
        item = await self._get(r.GAMECOMMENTS_PK, game_id, r.COMMENTS, r.COMMENT_BYTES)
        if item is None or r.COMMENT_BYTES in item:
            return None
        existing = item.get(r.COMMENTS, {}).get("L")
        comments = existing if isinstance(existing, list) else []
        total = sum(
            comment_weight(c.get("M", {}).get(r.COMMENT, {}).get("S", "")) for c in comments
        )
        if total + weight >= COMMENTS_CAP_BYTES:
            return AppendOutcome(AppendStatus.FULL)
        names = {"#c": r.COMMENTS, "#b": r.COMMENT_BYTES, "#ids": r.COMMENT_IDS}
        values: dict[str, Any] = {
            ":new": {"L": [_comment_value(comment)]},
            ":total": number(total + weight),
            ":ids": {"M": {key: number(comment.time_stamp)}},
        }
        if existing is None:
            condition = "attribute_not_exists(#b) AND attribute_not_exists(#c)"
            expression = "SET #c = :new, #b = :total, #ids = :ids"
        else:
            condition = "attribute_not_exists(#b) AND size(#c) = :n"
            expression = "SET #c = list_append(#c, :new), #b = :total, #ids = :ids"
            values[":n"] = number(len(comments))
        applied = await self._update_ignoring_condition(
            Key=_key(r.GAMECOMMENTS_PK, game_id),
            UpdateExpression=expression,
            ConditionExpression=condition,
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=values,
        )
        if not applied:
            return None
        log.info("counted %d existing comments of game %s: %d bytes", len(comments), game_id, total)
        return AppendOutcome(AppendStatus.STORED, comment.time_stamp)

    # --- dashboard marks ----------------------------------------------------------

    async def game_watchers(self, game_id: str) -> list[str]:
        watchers: list[str] = []
        params: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "#pk = :pk",
            "ProjectionExpression": "#sk",
            "ExpressionAttributeNames": {"#pk": "pk", "#sk": "sk"},
            "ExpressionAttributeValues": {":pk": {"S": r.GAMEWATCHERS_PREFIX + game_id}},
        }
        while True:
            response = await self._call("query", **params)
            watchers.extend(item["sk"]["S"] for item in response.get("Items", []))
            last_key = response.get("LastEvaluatedKey")
            if not last_key:
                return watchers
            params["ExclusiveStartKey"] = last_key

    async def _existing_keys(self, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of these rows exist."""
        return set(await self._batch_get(keys, ()))

    async def _batch_get(
        self, keys: list[tuple[str, str]], names: Sequence[str]
    ) -> dict[tuple[str, str], Item]:
        """These rows (those that exist), projecting the keys and ``names``: BatchGetItem,
        100 keys per request, consistent."""
        found: dict[tuple[str, str], Item] = {}
        aliases = {"#pk": "pk", "#sk": "sk", **{f"#n{i}": n for i, n in enumerate(names)}}
        for start in range(0, len(keys), 100):
            pending: list[Item] = [_key(pk, sk) for pk, sk in keys[start : start + 100]]
            retrying = UNPROCESSED_KEYS_BACKOFF.start()
            while True:
                response = await self._call(
                    "batch_get_item",
                    RequestItems={
                        self.table: {
                            "Keys": pending,
                            "ProjectionExpression": ", ".join(aliases),
                            "ExpressionAttributeNames": aliases,
                            "ConsistentRead": True,
                        }
                    },
                )
                for item in response.get("Responses", {}).get(self.table, []):
                    found[(item["pk"]["S"], item["sk"]["S"])] = item
                pending = response.get("UnprocessedKeys", {}).get(self.table, {}).get("Keys", [])
                if not pending:
                    break
                if not await retrying.wait():
                    raise StoreUnavailable(f"BatchGetItem on {self.table!r} left keys unprocessed")
        return found

    async def mark_players_last_chat(
        self, game_id: str, players: Sequence[str], authors: Mapping[str, int]
    ) -> None:
        if not authors:
            return  # no comment, nothing to mark (and nothing to read)
        unique = list(dict.fromkeys(players))
        wanted = [(r.CURRENTGAMES_PREFIX + p, game_id) for p in unique]
        wanted += [(r.BOT_PK, p) for p in unique]
        found = await self._existing_keys(wanted)
        humans = [
            p
            for p in unique
            if (r.CURRENTGAMES_PREFIX + p, game_id) in found and (r.BOT_PK, p) not in found
        ]
        # The overlay row is an upsert, as the backend's upsertUserGameOverlay does.
        await self._mark(r.USERGAME_PREFIX, game_id, humans, authors, must_exist=False)

    async def mark_watchers_last_chat(
        self, game_id: str, watchers: Sequence[str], authors: Mapping[str, int]
    ) -> None:
        unique = list(dict.fromkeys(watchers))
        await self._mark(r.WATCHED_PREFIX, game_id, unique, authors, must_exist=True)

    async def _mark(
        self,
        prefix: str,
        game_id: str,
        users: list[str],
        authors: Mapping[str, int],
        *,
        must_exist: bool,
    ) -> None:
        if not authors:
            return  # no comment, nothing to mark
        gate = asyncio.Semaphore(MARK_CONCURRENCY)
        at_ms = max(authors.values())

        async def mark(user: str) -> None:
            names = {"#lc": r.LAST_CHAT}
            values: dict[str, Any] = {":lc": number(at_ms)}
            expression = "SET #lc = :lc"
            own = authors.get(user)
            if own is not None:
                names["#seen"] = r.SEEN
                values[":seen"] = number(own + r.AUTHOR_SEEN_LEAD_MS)
                expression += ", #seen = :seen"
            params: dict[str, Any] = {
                "Key": _key(prefix + user, game_id),
                "UpdateExpression": expression,
                "ExpressionAttributeNames": names,
                "ExpressionAttributeValues": values,
            }
            # Marks may be retried, so an older one arriving late must not win.
            condition = "(attribute_not_exists(#lc) OR #lc < :lc)"
            if must_exist:
                condition = "attribute_exists(pk) AND " + condition
            params["ConditionExpression"] = condition
            async with gate:
                await self._update_ignoring_condition(**params)

        async with asyncio.TaskGroup() as group:
            for user in users:
                group.create_task(mark(user))

    # --- lastSeen -------------------------------------------------------------------

    def _last_seen_update(self, user_id: str, now_ms: int) -> dict[str, Any]:
        return {
            "Key": _key(r.USERS_PK, user_id),
            "UpdateExpression": "SET #ls = :now",
            "ConditionExpression": (
                "attribute_exists(pk) AND (attribute_not_exists(#ls) OR #ls < :stale)"
            ),
            "ExpressionAttributeNames": {"#ls": r.LAST_SEEN},
            "ExpressionAttributeValues": {
                ":now": number(now_ms),
                ":stale": number(now_ms - r.LAST_SEEN_INTERVAL_MS),
            },
        }

    async def touch_last_seen(self, user_id: str, now_ms: int) -> bool:
        return await self._update_ignoring_condition(**self._last_seen_update(user_id, now_ms))

    async def touch_last_seen_many(self, touches: Mapping[str, int]) -> set[str]:
        """A BatchGetItem per 100 users finds the rows that need a write (missing rows
        and fresh ``lastSeen`` need none). Rows that have a stale ``lastSeen`` are
        written 25 to a PartiQL ``BatchExecuteStatement``, each update conditional on
        ``lastSeen`` still holding the value read: a row written meanwhile is left
        alone. A row with no ``lastSeen`` yet gets the conditional UpdateItem of
        :meth:`touch_last_seen` (no equality can say "still missing").

        Equalities, because moto, which the tests run against, evaluates only those
        in a PartiQL ``WHERE`` (it takes ``<`` and ``IS MISSING`` as true; and where
        an equality fails it answers no error, so it counts such a row as written).
        TransactWriteItems would be all or nothing at twice the write cost.
        """
        if not touches:
            return set()
        rows = await self._batch_get([(r.USERS_PK, user) for user in touches], (r.LAST_SEEN,))
        stale: list[tuple[str, AttributeValue]] = []
        unseen: list[str] = []
        for user, at in touches.items():
            row = rows.get((r.USERS_PK, user))
            if row is None:
                continue
            read = row.get(r.LAST_SEEN)
            if read is None:
                unseen.append(user)
                continue
            last = parse_int(read)
            if last is None or last < at - r.LAST_SEEN_INTERVAL_MS:
                stale.append((user, read))
        written: set[str] = set()
        gate = asyncio.Semaphore(MARK_CONCURRENCY)

        async def touch(user: str) -> None:
            async with gate:
                if await self.touch_last_seen(user, touches[user]):
                    written.add(user)

        async def touch_chunk(chunk: list[tuple[str, AttributeValue]]) -> None:
            async with gate:
                written.update(await self._touch_still_as_read(chunk, touches))

        try:
            async with asyncio.TaskGroup() as group:
                for start in range(0, len(stale), LAST_SEEN_STATEMENTS):
                    group.create_task(touch_chunk(stale[start : start + LAST_SEEN_STATEMENTS]))
                for user in unseen:
                    group.create_task(touch(user))
        except* StoreUnavailable as failed:
            raise failed.exceptions[0] from None  # what every store method raises
        return written

    async def _touch_still_as_read(
        self, chunk: Sequence[tuple[str, AttributeValue]], touches: Mapping[str, int]
    ) -> set[str]:
        """One ``BatchExecuteStatement``: each user's ``lastSeen`` set to its touch,
        where it still holds the value read. Statements DynamoDB throttled or failed
        inside are sent again; a failed condition means "written meanwhile"."""
        update = (
            f'UPDATE "{self.table}" SET "{r.LAST_SEEN}" = ? '
            f'WHERE "pk" = ? AND "sk" = ? AND "{r.LAST_SEEN}" = ?'
        )
        pending = {
            user: {
                "Statement": update,
                "Parameters": [number(touches[user]), {"S": r.USERS_PK}, {"S": user}, read],
            }
            for user, read in chunk
        }
        written: set[str] = set()
        retrying = UNPROCESSED_KEYS_BACKOFF.start()
        while True:
            users = list(pending)
            response = await self._call(
                "batch_execute_statement", Statements=[pending[user] for user in users]
            )
            again: dict[str, dict[str, Any]] = {}
            for user, answer in zip(users, response.get("Responses", []), strict=True):
                error = answer.get("Error")
                if error is None:
                    written.add(user)
                elif error.get("Code") in RETRYABLE_STATEMENT_ERRORS:
                    again[user] = pending[user]
                elif error.get("Code") != "ConditionalCheckFailed":
                    raise StoreUnavailable(
                        f"lastSeen of {user!r} not written: {error.get('Code')}: "
                        f"{error.get('Message', '')}"
                    )
            if not again:
                return written
            if not await retrying.wait():
                raise StoreUnavailable(
                    f"BatchExecuteStatement on {self.table!r} left {len(again)} updates undone"
                )
            pending = again

    # --- a bot's candidate games (BOTTURNS#) -------------------------------------------

    async def add_bot_candidates(
        self, candidates: Sequence[tuple[str, str, str]], now_ms: int
    ) -> None:
        # Puts, not UpdateItems: the row is only these attributes, so a put is the
        # same upsert, and a batch of moves is one BatchWriteItem, not one request each.
        items = {
            (bot_id, game_id): {
                **_key(r.BOTTURNS_PREFIX + bot_id, game_id),
                r.META_GAME: {"S": meta},
                r.ADDED_AT: number(now_ms),
                r.TTL: number(now_ms // 1000 + BOT_CANDIDATE_TTL_SECONDS),
            }
            for bot_id, meta, game_id in candidates
        }
        await self._batch_write([{"PutRequest": {"Item": item}} for item in items.values()])

    async def bot_candidates(self, bot_id: str) -> list[BotCandidate]:
        params: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "#pk = :pk",
            "ProjectionExpression": "#sk, #meta, #at",
            "ExpressionAttributeNames": {
                "#pk": "pk",
                "#sk": "sk",
                "#meta": r.META_GAME,
                "#at": r.ADDED_AT,
            },
            "ExpressionAttributeValues": {":pk": {"S": r.BOTTURNS_PREFIX + bot_id}},
            "ConsistentRead": True,
        }
        found: list[BotCandidate] = []
        while True:
            response = await self._call("query", **params)
            for item in response.get("Items", []):
                meta = item.get(r.META_GAME, {}).get("S", "")
                if meta:
                    added = parse_int(item.get(r.ADDED_AT)) or 0
                    found.append(BotCandidate(item["sk"]["S"], meta, added))
            last_key = response.get("LastEvaluatedKey")
            if not last_key:
                return found
            params["ExclusiveStartKey"] = last_key

    async def drop_bot_candidate(self, bot_id: str, game_id: str, added_at_ms: int) -> bool:
        try:
            await self._call(
                "delete_item",
                passthrough=_CCF,
                TableName=self.table,
                Key=_key(r.BOTTURNS_PREFIX + bot_id, game_id),
                ConditionExpression="#at = :at",
                ExpressionAttributeNames={"#at": r.ADDED_AT},
                ExpressionAttributeValues={":at": number(added_at_ms)},
            )
        except ClientError as exc:
            if not _is_ccf(exc):
                raise
            return False
        return True

    async def active_games(self, keys: Sequence[tuple[str, str]]) -> dict[str, CurrentGame]:
        wanted = [(r.GAME_PK, r.game_sk(meta, game_id, completed=False)) for meta, game_id in keys]
        rows = await self._batch_get(wanted, ("id", r.META_GAME, r.PLAYERS, "toMove"))
        games: dict[str, CurrentGame] = {}
        for item in rows.values():
            game = current_game_from_item(item)
            if game is not None:
                games[game.game_id] = game
        return games
