"""Game chat over the WebSocket: authorize, store once and in order, acknowledge, fan out.

The path of one ``chat`` action (``docs/protocol.md``, "Chat"):

1. the author's rate (``--chat-rate`` per 10 s, cluster-wide when clustered);
2. authorization as today: the active ``GAME`` row's players (read with a
   projection, and kept a few seconds: :mod:`server.services.game_access`), or a
   site admin (``USER.admin``); completed and unknown games are refused;
3. the game's group commit (:mod:`server.runtime.group_commit`): comments queued
   on the game while a batch is being written go together in the next one, taken
   once the writer holds the lock (what queued while it waited goes in too).
   Under the game's lock (:mod:`server.coordination.game_lock`), a batch is one
   conditional append to ``GAMECOMMENTS`` (cap and idempotency enforced by
   DynamoDB, one answer per comment), the ``chatAck`` of each, then each one's
   ``chat`` event and ``game`` hint, all in one append, so the stored order and
   the order of the game's events are the same; on Redis that append also
   releases the lock. Three Redis round trips a comment at most (the rate, and
   the batch's lock and append), and one DynamoDB write a batch: a busy game
   waits for one write in flight, not for a queue of them;
4. dashboard marks, queued for write-behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.codec import Frame
from protocol.errors import ErrorCode
from protocol.messages import Broadcast, Chat, ChatAck
from protocol.parse import parse_broadcast
from server.bus.streams import Fence
from server.coordination.game_lock import GameLocks, LockUnavailable
from server.coordination.rate_limit import RateLimiter
from server.runtime.backoff import Backoff
from server.runtime.group_commit import GroupClosed, GroupCommit, Turn
from server.runtime.metrics import Registry
from server.services import Publish
from server.services.chat_marks import ChatMarks
from server.services.game_access import GameAccessCache
from server.session import Session
from server.store.base import Store, StoreUnavailable
from server.store.records import AppendStatus, GameStatus, StoredComment, comment_key

log = logging.getLogger(__name__)

RATE_WINDOW_SECONDS = 10.0

MAX_BATCH = 50
"""Most comments of one game written under one hold of its lock."""

ANNOUNCE_BACKOFF = Backoff(first=0.05, cap=1.0)
ANNOUNCE_WITHIN_SECONDS = 10.0
"""How long a batch's events are retried (under its lock) once its comments are
stored and acked: every event is named, so a retry after a failure whose first
try did reach Redis takes no second position."""

CLOSE_GRACE_SECONDS = 5.0
"""On shutdown, how long the comments already queued have to be written (and acked)
before they are refused as ``unavailable``."""


class _ChatCounters:
    def __init__(self, registry: Registry) -> None:
        self.stored = registry.counter("ap_chat_comments_stored_total", "Comments appended")
        self.refused = registry.counter(
            "ap_chat_comments_refused_total", "Chat actions answered with an error frame"
        )
        self.duplicate = registry.counter(
            "ap_chat_duplicates_total", "Chat actions whose clientMsgId was already stored"
        )
        # Where a batch's time goes: divided by the batches, each step's mean.
        self.batches = registry.counter(
            "ap_chat_batches_total", "Batches of a game's comments written under one lock hold"
        )
        self.lock_wait = registry.counter(
            "ap_chat_batch_lock_wait_seconds_total", "Time batches waited for their game's lock"
        )
        self.store_write = registry.counter(
            "ap_chat_batch_store_seconds_total", "Time batches spent appending to GAMECOMMENTS"
        )
        self.announce = registry.counter(
            "ap_chat_batch_publish_seconds_total", "Time batches spent appending their events"
        )
        self.announce_retries = registry.counter(
            "ap_chat_publish_retries_total", "Appends of a batch's events tried again"
        )
        self.unannounced = registry.counter(
            "ap_chat_unannounced_total",
            "Stored comments whose events could not be appended (seen on refetch only)",
        )


class ChatRefused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class _Post:
    session: Session
    user_id: str
    action: Chat
    players: asyncio.Task[tuple[str, ...]]  # its authorization: the game's players


class ChatService:
    def __init__(
        self,
        store: Store,
        publish: Publish,
        locks: GameLocks,
        limiter: RateLimiter,
        marks: ChatMarks,
        outbox_limit: int,
        *,
        metrics: Registry | None = None,
    ) -> None:
        self._counters = _ChatCounters(metrics or Registry())
        self._store = store
        self._access = GameAccessCache(store.get_game_access, metrics=metrics)
        self._publish = publish
        self._locks = locks
        self._limiter = limiter
        self._marks = marks
        self._outbox_limit = outbox_limit
        self._last_ms = 0
        self._commits: GroupCommit[str, _Post, StoredComment | None] = GroupCommit(
            "chat-commit", self._write, max_batch=MAX_BATCH
        )

    async def close(self) -> None:
        await self._commits.close(grace=CLOSE_GRACE_SECONDS)
        await self._access.close()
        await self._locks.close()
        await self._limiter.close()

    async def post(self, session: Session, action: Chat) -> None:
        """Handle one ``chat`` action up to its place in the game's queue; the author
        gets a ``chatAck`` or an error frame when its batch is written. Returns once
        queued, so the connection's next comment can join the same batch, and the
        connection's comments are queued in the order it sent them."""
        user_id = session.user_id
        assert user_id is not None
        if not await self._limiter.allow(user_id):
            self._refuse(
                session,
                action,
                ChatRefused(
                    ErrorCode.RATE_LIMITED, "too many comments; wait a few seconds and try again"
                ),
            )
            return
        # Authorized while it waits for its batch; a busy game's row is kept, not read.
        players = asyncio.create_task(self._authorize(user_id, action), name="chat-authorize")
        queued = _Post(session, user_id, action, players)
        written = self._commits.submit(action.key, queued)
        written.add_done_callback(lambda done: self._written(done, queued))

    def _written(self, done: asyncio.Future[StoredComment | None], post: _Post) -> None:
        """A comment's batch is written (its ack, if any, has gone with the batch)."""
        read = post.players
        if not read.done():  # the batch was refused before it was read
            read.cancel()
        elif not read.cancelled():
            read.exception()  # seen: a refusal it raised is in ``done``, or moot
        if done.cancelled():
            return
        exc = done.exception()
        action = post.action
        if isinstance(exc, ChatRefused):
            self._refuse(post.session, action, exc)
        elif isinstance(exc, StoreUnavailable | LockUnavailable | GroupClosed):
            self._refuse(post.session, action, self._unavailable(post.user_id, action, exc))
        elif exc is not None:
            log.error("chat on %s by %s failed", action.key, post.user_id, exc_info=exc)
            self._refuse(post.session, action, self._unavailable(post.user_id, action, exc))
        else:
            stored = done.result()
            if stored is not None:  # None: a duplicate, marked the first time
                players = post.players.result()
                self._marks.queue(action.game_id, players, post.user_id, stored.time_stamp)

    def _unavailable(self, user_id: str, action: Chat, exc: BaseException) -> ChatRefused:
        log.warning("chat on %s by %s failed: %s", action.key, user_id, exc)
        return ChatRefused(ErrorCode.UNAVAILABLE, "the comment could not be saved; try again")

    def _refuse(self, session: Session, action: Chat, refused: ChatRefused) -> None:
        self._counters.refused.inc()
        session.send_error(refused.code, refused.message, self._outbox_limit, action.client_msg_id)

    async def _write(self, key: str, turn: Turn[_Post]) -> list[StoredComment | Exception | None]:
        """One batch of a game's comments (see the module's docstring, step 3): the
        stored comment for each, None for a duplicate, or its refusal. The batch is
        taken once the lock is held: what queued meanwhile, its authorization read,
        goes in too."""
        # Not under the lock: the first comment's read (later ones that are still
        # reading wait for the next batch).
        await asyncio.wait([turn.first.players])
        counters = self._counters
        counters.batches.inc()
        asked = time.perf_counter()
        async with self._locks.hold(key) as held:
            started = time.perf_counter()
            counters.lock_wait.inc(started - asked)
            posts = turn.take(ready=lambda post: post.players.done())
            answers: list[StoredComment | Exception | None] = [None] * len(posts)
            admitted: list[tuple[int, _Post]] = []
            for index, post in enumerate(posts):
                if post.players.cancelled():
                    answers[index] = GroupClosed("the comment's authorization was cancelled")
                elif (refused := post.players.exception()) is not None:
                    answers[index] = (
                        refused if isinstance(refused, Exception) else GroupClosed(str(refused))
                    )
                else:
                    admitted.append((index, post))
            if not admitted:
                return answers
            game_id = posts[0].action.game_id
            entries = [
                (
                    StoredComment(
                        comment=post.action.comment,
                        user_id=post.user_id,
                        move_number=post.action.move_number,
                        time_stamp=self._now_ms(),
                    ),
                    comment_key(post.user_id, post.action.client_msg_id),
                )
                for _, post in admitted
            ]
            outcomes = await self._store.append_comments(game_id, entries)
            written = time.perf_counter()
            counters.store_write.inc(written - started)
            new: list[tuple[Chat, StoredComment]] = []
            for (index, post), (comment, _), outcome in zip(
                admitted, entries, outcomes, strict=True
            ):
                if outcome.status is AppendStatus.FULL:
                    answers[index] = ChatRefused(
                        ErrorCode.COMMENTS_FULL,
                        "this game's comments are full; no more can be added",
                    )
                    continue
                self._ack(post.session, post.action, outcome.time_stamp)
                if outcome.status is AppendStatus.DUPLICATE:
                    self._counters.duplicate.inc()
                    continue  # None: stored and announced the first time
                self._counters.stored.inc()
                new.append((post.action, comment))
                answers[index] = comment
            if new:
                await self._announce(new, held.fence())
                counters.announce.inc(time.perf_counter() - written)
        return answers

    async def _authorize(self, user_id: str, action: Chat) -> tuple[str, ...]:
        access = await self._access.get(action.meta, action.game_id)
        if access.status is GameStatus.MISSING:
            raise ChatRefused(ErrorCode.GAME_NOT_FOUND, "game not found")
        if access.status is GameStatus.COMPLETED:
            raise ChatRefused(
                ErrorCode.GAME_COMPLETED,
                "the game is over; post-game comments go through the game's exploration",
            )
        if user_id not in access.players and not await self._store.is_admin(user_id):
            raise ChatRefused(
                ErrorCode.NOT_ALLOWED, "only the game's players and admins can comment"
            )
        return access.players

    def _ack(self, session: Session, action: Chat, time_stamp: int) -> None:
        session.send(Frame(ChatAck(action.client_msg_id, time_stamp)), self._outbox_limit)

    async def _announce(
        self, comments: Sequence[tuple[Chat, StoredComment]], fence: Fence | None
    ) -> None:
        """For each comment, in stored order: the ``chat`` event (everyone, the author's
        other tabs too), then today's ``game`` hint without the author, on which the
        browser refetches. All in one append, the last under the game lock's
        ``fence`` (which releases the lock in the same round trip)."""
        events: list[tuple[Broadcast, str]] = []
        for action, comment in comments:
            ref = {"meta": action.meta, "id": action.game_id}
            chat = {
                "verb": "chat",
                "payload": {**ref, **comment.to_plain(), "clientMsgId": action.client_msg_id},
            }
            game = {"verb": "game", "payload": ref, "exclude": [comment.user_id]}
            # Named by the comment: each is appended once, however often it is sent.
            name = f"chat:{action.key}:{comment_key(comment.user_id, action.client_msg_id)}"
            events.append((parse_broadcast(json.dumps(chat)), f"{name}:chat"))
            events.append((parse_broadcast(json.dumps(game)), f"{name}:game"))
        (first, first_id), *rest = events
        retrying = ANNOUNCE_BACKOFF.start(deadline=time.monotonic() + ANNOUNCE_WITHIN_SECONDS)
        while True:
            try:
                await self._publish(first, event_id=first_id, then=rest, fence=fence)
                return
            except Exception as exc:
                if not await retrying.wait():
                    # Stored and acked: their clients see them on the next refetch.
                    self._counters.unannounced.inc(len(comments))
                    log.warning(
                        "could not publish chat for %s, %d comment(s) stored unannounced: %s",
                        comments[0][0].key,
                        len(comments),
                        exc,
                    )
                    return
                self._counters.announce_retries.inc()
                if retrying.failures == 1:
                    log.info("retrying the chat events of %s: %s", comments[0][0].key, exc)

    def _now_ms(self) -> int:
        # Never backwards on this node, so one node's comments keep their order by time.
        self._last_ms = max(time.time_ns() // 1_000_000, self._last_ms)
        return self._last_ms
