"""Game chat over the WebSocket: authorize, store once and in order, acknowledge, fan out.

The path of one ``chat`` action (``docs/protocol.md``, "Chat"):

1. the author's rate (``--chat-rate`` per 10 s, cluster-wide when clustered);
2. authorization as today: the active ``GAME`` row's players (read with a
   projection), or a site admin (``USER.admin``); completed and unknown games
   are refused;
3. under the game's lock (:mod:`server.coordination.game_lock`): one conditional
   append to ``GAMECOMMENTS`` (cap and idempotency enforced by DynamoDB), the
   ``chatAck``, then the ``chat`` event and the ``game`` hint published, so the
   stored order and the order of the game's events are the same;
4. dashboard marks, queued for write-behind.
"""

from __future__ import annotations

import json
import logging
import time

from protocol.codec import Frame
from protocol.errors import ErrorCode
from protocol.messages import Chat, ChatAck
from protocol.parse import parse_broadcast
from server.coordination.game_lock import GameLocks, LockUnavailable
from server.coordination.rate_limit import RateLimiter
from server.runtime.metrics import Registry
from server.services import Publish
from server.services.chat_marks import ChatMarks
from server.session import Session
from server.store.base import Store, StoreUnavailable
from server.store.records import AppendStatus, GameStatus, StoredComment, comment_key

log = logging.getLogger(__name__)

RATE_WINDOW_SECONDS = 10.0


class _ChatCounters:
    def __init__(self, registry: Registry) -> None:
        self.stored = registry.counter("ap_chat_comments_stored_total", "Comments appended")
        self.refused = registry.counter(
            "ap_chat_comments_refused_total", "Chat actions answered with an error frame"
        )
        self.duplicate = registry.counter(
            "ap_chat_duplicates_total", "Chat actions whose clientMsgId was already stored"
        )


class ChatRefused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
        self._publish = publish
        self._locks = locks
        self._limiter = limiter
        self._marks = marks
        self._outbox_limit = outbox_limit
        self._last_ms = 0

    async def close(self) -> None:
        await self._locks.close()
        await self._limiter.close()

    async def post(self, session: Session, action: Chat) -> None:
        """Handle one ``chat`` action; the author gets a ``chatAck`` or an error frame."""
        user_id = session.user_id
        assert user_id is not None
        try:
            await self._post(session, user_id, action)
        except ChatRefused as refused:
            self._counters.refused.inc()
            session.send_error(
                refused.code, refused.message, self._outbox_limit, action.client_msg_id
            )

    async def _post(self, session: Session, user_id: str, action: Chat) -> None:
        if not await self._limiter.allow(user_id):
            raise ChatRefused(
                ErrorCode.RATE_LIMITED, "too many comments; wait a few seconds and try again"
            )
        try:
            players = await self._authorize(user_id, action)
            async with self._locks.hold(action.key) as held:
                comment = StoredComment(
                    comment=action.comment,
                    user_id=user_id,
                    move_number=action.move_number,
                    time_stamp=self._now_ms(),
                )
                key = comment_key(user_id, action.client_msg_id)
                outcome = await self._store.append_comment(action.game_id, comment, key)
                if outcome.status is AppendStatus.FULL:
                    raise ChatRefused(
                        ErrorCode.COMMENTS_FULL,
                        "this game's comments are full; no more can be added",
                    )
                self._ack(session, action, outcome.time_stamp)
                if outcome.status is AppendStatus.DUPLICATE:
                    self._counters.duplicate.inc()
                    return  # stored and announced the first time
                self._counters.stored.inc()
                await held.confirm()
                await self._announce(action, comment)
        except (StoreUnavailable, LockUnavailable) as exc:
            log.warning("chat on %s by %s failed: %s", action.key, user_id, exc)
            raise ChatRefused(
                ErrorCode.UNAVAILABLE, "the comment could not be saved; try again"
            ) from exc
        self._marks.queue(action.game_id, players, user_id, comment.time_stamp)

    async def _authorize(self, user_id: str, action: Chat) -> tuple[str, ...]:
        access = await self._store.get_game_access(action.meta, action.game_id)
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

    async def _announce(self, action: Chat, comment: StoredComment) -> None:
        """The ``chat`` event (everyone, the author's other tabs too), then today's
        ``game`` hint without the author, on which the browser refetches."""
        ref = {"meta": action.meta, "id": action.game_id}
        chat = {
            "verb": "chat",
            "payload": {**ref, **comment.to_plain(), "clientMsgId": action.client_msg_id},
        }
        game = {"verb": "game", "payload": ref, "exclude": [comment.user_id]}
        # Named by the comment: each is appended once, however often it is sent.
        name = f"chat:{action.key}:{comment_key(comment.user_id, action.client_msg_id)}"
        for body in (chat, game):
            try:
                await self._publish(
                    parse_broadcast(json.dumps(body)), event_id=f"{name}:{body['verb']}"
                )
            except Exception as exc:  # the comment is stored: clients see it on refetch
                log.warning("could not publish %s for %s: %s", body["verb"], action.key, exc)

    def _now_ms(self) -> int:
        # Never backwards on this node, so one node's comments keep their order by time.
        self._last_ms = max(time.time_ns() // 1_000_000, self._last_ms)
        return self._last_ms
