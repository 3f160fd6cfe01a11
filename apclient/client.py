"""The asyncio client: one socket at a time, reconnected by the close-code policy,
recovering by position, handing every event to the application exactly once.

The decisions live in sans-I/O modules (``policy``, ``streams``, ``presence``,
``turns``); this module only moves frames between the socket and them, runs the
handlers, and keeps time.

Handlers run in *lanes*: one task per game (a game's stream, and user events
that name the game, such as ``yourTurn``), one per other stream, one per other
verb. A lane runs its handlers one after another, in arrival order; lanes run
side by side, and the socket is read by its own task, so a slow handler delays
neither reading nor other games.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import logging
import os
import random
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.proxy import get_proxy
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from apclient.events import (
    AnyEvent,
    Connected,
    Disconnected,
    Event,
    Presence,
    PresenceChange,
    RecoveryInfo,
    ResyncInfo,
    ServerError,
    State,
    Turn,
    TurnSource,
)
from apclient.policy import Plan, Wait, close_plan, connect_plan, wait_seconds
from apclient.presence import apply_presence
from apclient.storage import Storage, storage_for
from apclient.streams import (
    Advance,
    Commits,
    Deliver,
    Output,
    Report,
    Resync,
    StreamFrame,
    Ticket,
    Tracker,
)
from apclient.tokens import TokenUnavailable, Unauthorized, token_claims
from apclient.turns import Candidate, TurnTracker
from protocol.client import (
    ClientBound,
    GameRef,
    UnknownFrame,
    encode_action,
    parse_server_frame,
    subscribe_action,
    sync_presence_action,
    watch_games_action,
)
from protocol.errors import (
    MAX_GAME_FIELD_CHARS,
    MAX_WATCHED_GAMES,
    MSGPACK_SUBPROTOCOL,
    ProtocolError,
)
from protocol.messages import (
    Ack,
    AdminTest,
    ChatAck,
    ErrorMessage,
    GameEvent,
    Heartbeat,
    PendingTurns,
    Position,
    Positioned,
    PresenceDelta,
    PresenceSnapshot,
    Recovered,
    Skip,
    UserEvent,
    game_key,
    ply_fields,
    ply_of,
)
from protocol.streams import MAX_SINCE_STREAMS, game_stream, stream_user, user_stream

log = logging.getLogger("apclient")

Handler = Callable[..., Any]
TokenGetter = Callable[..., "str | Awaitable[str | None] | None"]

CLIENT_LANE = "client"
"""Lifecycle events (state, connected, disconnected, error) run in this lane."""
LIFECYCLE_GRACE = 5.0
"""Seconds ``close`` waits for the last lifecycle handlers (the final ``disconnected``)."""
HEARTBEAT_READ_FACTOR = 3
"""A subscribed socket silent for this many server heartbeats is replaced."""


class ClientStopped(Exception):
    """The client stopped for good (4509, unauthorized): why is in ``info``."""

    def __init__(self, info: Disconnected) -> None:
        super().__init__(f"{info.code} {info.reason}")
        self.info = info


class GamesRefused(Exception):
    """``set_games`` was refused by the server (``too_many_games``): the old set stays."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class _Watch:
    ack_id: str
    previous: list[GameRef]
    added: list[str]


@dataclass
class _Outcome:
    """How one attempt ended."""

    code: int
    reason: str
    plan: Plan
    retry_after: float = 0.0
    report: bool = True  # an attempt at a socket ended: a disconnected event is due


T = TypeVar("T")


class _Feed(Generic[T]):
    """An ``async for`` over the client's events: an item counts as handled (its
    position may commit) once the loop asks for the next one."""

    def __init__(self, client: RealtimeClient) -> None:
        self._client = client
        self._items: deque[tuple[T, Ticket | None]] = deque()
        self._current: Ticket | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False

    def __aiter__(self) -> _Feed[T]:
        return self

    def put(self, item: T, ticket: Ticket | None) -> None:
        self._items.append((item, ticket))
        self._wake()

    def end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def __anext__(self) -> T:
        self._release()
        while not self._items:
            if self._ended:
                self._client._feed_done(self)
                stopped = self._client._stopped_by_server
                if stopped is not None:
                    raise ClientStopped(stopped)
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._current = self._items.popleft()
        return item

    async def aclose(self) -> None:
        self._close()

    def _release(self) -> None:
        ticket, self._current = self._current, None
        if ticket is not None:
            self._client._release(ticket)

    def _close(self) -> None:
        self._release()
        while self._items:
            _, ticket = self._items.popleft()
            if ticket is not None:
                self._client._release(ticket)
        self._ended = True
        self._client._feed_done(self)

    def __del__(self) -> None:
        # A loop that broke out early leaves its feed behind: what it held counts as done.
        with contextlib.suppress(Exception):
            if not self._ended or self._current is not None or self._items:
                self._close()


class RealtimeClient:
    """A client of the Abstract Play real-time server.

    ``async with RealtimeClient(url, get_token=...) as client:`` connects (and
    keeps reconnecting) until the block ends or the client stops. See
    ``docs/clients.md`` for the behaviour; in short:

    - ``url``: one address, or several: each failure moves to another, at random.
    - ``get_token``: called (sync or async) before every connect, one call at a
      time; with ``refresh=True`` once after the server refused the token
      (1008), when it has a parameter named ``refresh``. None or :class:`Unauthorized`
      stops the client; any other exception is retried with backoff.
    - ``games``: the games to watch (``set_games`` changes them).
    - ``storage``: where positions are kept: a file path, a :class:`Storage`,
      or None for memory.
    - ``coalesce``: verbs whose replayed bursts reach a handler as one event
      per stream (``event.batch`` holds them all), e.g. ``("game",)``.
    - ``on_resync(stream, info)``: the same as ``on("resync", fn)``.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        get_token: TokenGetter,
        games: Iterable[GameRef] = (),
        storage: Storage | str | os.PathLike[str] | None = None,
        coalesce: Iterable[str] = (),
        on_resync: Callable[[str, ResyncInfo], Any] | None = None,
        invisible: bool = False,
        wants_presence: bool | None = None,
        connect_timeout: float = 10.0,
        ack_timeout: float = 15.0,
        read_timeout: float | None = None,
        binary: bool = False,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._urls = [url] if isinstance(url, str) else list(url)
        if not self._urls:
            raise ValueError("RealtimeClient needs at least one url")
        self._url_index = 0
        self._get_token = get_token
        self._token_takes_refresh = _takes_refresh(get_token)
        self._storage = storage_for(storage)
        stored = self._storage.load()
        self._tracker = Tracker(stored, coalesce)
        self._commits = Commits(stored)
        self._turns = TurnTracker()
        self._desired = _clean(games)
        self._held: list[GameRef] = []
        self.invisible = invisible
        self.wants_presence = wants_presence
        self.connect_timeout = connect_timeout
        self.ack_timeout = ack_timeout
        self.read_timeout = read_timeout
        self.binary = binary
        self._rand = rand
        self._handlers: dict[str, list[Handler]] = {}
        self._lanes: dict[str, deque[Callable[[], Awaitable[None]]]] = {}
        self._lane_tasks: dict[str, asyncio.Task[None]] = {}
        self._events: weakref.WeakSet[_Feed[AnyEvent]] = weakref.WeakSet()
        self._turn_feeds: weakref.WeakSet[_Feed[Turn]] = weakref.WeakSet()
        self._state: State = "disconnected"
        self.presence: Presence | None = None
        self._syncing = False
        self._ws: ClientConnection | None = None
        self._token: str | None = None
        self._user_stream: str | None = None
        self._attempt = 0
        self._refreshed = False
        self._refresh_next = False
        self._last_error: str | None = None
        self._ack_ids = itertools.count(1)
        self._subscribe_ack: str | None = None
        self._watch: _Watch | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._read_seconds: float | None = None
        self._gave_up: str | None = None  # why this side dropped the socket
        self._now = False  # reconnect_now: skip the wait
        self._wake = asyncio.Event()
        self._run_task: asyncio.Task[None] | None = None
        self._stopped = True
        self._closed = False
        self._stopped_by_server: Disconnected | None = None
        self._sends: set[asyncio.Task[None]] = set()
        self._state_waiters: list[asyncio.Future[None]] = []
        if on_resync is not None:
            self.on("resync", on_resync)

    # --- the surface ----------------------------------------------------------

    @property
    def state(self) -> State:
        """``connecting`` until a subscribe is acknowledged, ``connected`` while it holds,
        ``disconnected`` before ``start`` and once stopped (4509, unauthorized, ``close``)."""
        return self._state

    @property
    def positions(self) -> dict[str, Position]:
        """Committed positions: every handler is done with each stream up to here."""
        return dict(self._commits.committed)

    @property
    def games(self) -> list[GameRef]:
        return list(self._desired)

    def on(self, verb: str, handler: Handler) -> Callable[[], None]:
        """Call ``handler`` (sync or async) for every ``verb``; returns the way to stop.

        Verbs: the server's (``game``, ``chat``, ``yourTurn``, ``challenge``,
        ``notification``, ``pendingTurns``, ``gameStart``, ``gameEnd``, ``test``,
        ``chatAck``) get an :class:`Event`; ``connections`` a
        :class:`PresenceChange`; ``recovered`` a :class:`RecoveryInfo`;
        ``resync`` is called with ``(stream, ResyncInfo)``; ``turn`` gets a
        :class:`Turn`; ``error`` a :class:`ServerError`; ``disconnected`` a
        :class:`Disconnected`; ``connected`` nothing; ``state`` the new state.
        """
        handlers = self._handlers.setdefault(verb, [])
        handlers.append(handler)

        def off() -> None:
            with contextlib.suppress(ValueError):
                handlers.remove(handler)

        return off

    def __aiter__(self) -> _Feed[AnyEvent]:
        """Every event (not turns), from now on, in arrival order."""
        feed: _Feed[AnyEvent] = _Feed(self)
        self._events.add(feed)
        if self._stopped and self._run_task is not None:
            feed.end()
        return feed

    def turns(self) -> _Feed[Turn]:
        """Every game where the bot must move, once per ply: from ``pendingTurns``
        after each subscribe and from ``yourTurn`` events (``docs/clients.md``)."""
        feed: _Feed[Turn] = _Feed(self)
        self._turn_feeds.add(feed)
        if self._stopped and self._run_task is not None:
            feed.end()
        return feed

    def set_games(self, games: Iterable[GameRef]) -> asyncio.Future[None]:
        """Watch exactly ``games``: sent once now (or with the next subscribe), and
        again after every reconnect. The future is done when the server acknowledged
        this set or a later one, and fails with :class:`GamesRefused` when it refused
        it (the previous set then stays, here and on the server)."""
        self._desired = _clean(games)
        if len(self._desired) > MAX_WATCHED_GAMES:
            raise ValueError(f"at most {MAX_WATCHED_GAMES} games can be watched at once")
        waiter = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(_retrieve)
        self._waiters.append(waiter)
        self._sync_games()
        return waiter

    def start(self) -> None:
        """Start connecting (``async with`` does it)."""
        if self._closed:
            raise RuntimeError("this client was closed")
        if self._run_task is None or self._run_task.done():
            self._stopped = False
            self._stopped_by_server = None
            self._set_state("connecting")
            self._run_task = asyncio.create_task(self._run(), name="apclient")

    def reconnect_now(self) -> None:
        """Reconnect at once: a connected client drops its socket, a waiting one stops
        waiting, a stopped one starts again."""
        if self._closed:
            return
        # The backoff step stays: it resets only once a subscribe is acknowledged.
        self._refreshed = False
        self._now = True
        if self._stopped:
            self.start()
            return
        if self._ws is not None:
            self._give_up("reconnect requested")
        self._wake.set()

    async def close(self) -> None:
        """Stop for good: close the socket, stop the handlers' lanes, end the iterators."""
        if self._closed:
            return
        self._closed = True
        was_stopped = self._stopped
        self._stopped = True
        self._wake.set()
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await ws.close(1000, "closed by the application")
        task = self._run_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sending in list(self._sends):
            sending.cancel()
        if not was_stopped:
            self._finish(Disconnected(1000, "closed by the application", False), by_server=False)
        self._end_feeds()
        # Handlers still at work are stopped; the last lifecycle events get a moment.
        lifecycle = self._lane_tasks.get(CLIENT_LANE)
        others = [t for lane, t in self._lane_tasks.items() if lane != CLIENT_LANE]
        for lane_task in others:
            lane_task.cancel()
        for lane_task in others:
            with contextlib.suppress(asyncio.CancelledError):
                await lane_task
        if lifecycle is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(lifecycle, LIFECYCLE_GRACE)

    async def __aenter__(self) -> RealtimeClient:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_connected(self) -> None:
        """Until the client is connected (at once if it is); :class:`ClientStopped`
        if it stops first. Bound it with ``asyncio.timeout``."""
        while self._state != "connected":
            if self._stopped and self._run_task is not None:
                raise ClientStopped(self._stopped_by_server or Disconnected(1000, "closed", False))
            changed = asyncio.get_running_loop().create_future()
            self._state_waiters.append(changed)
            await changed

    # --- the connection loop --------------------------------------------------

    async def _run(self) -> None:
        while not self._stopped:
            try:
                outcome = await self._attempt_once()
            except Exception:
                log.exception("an attempt failed unexpectedly")
                outcome = _Outcome(1006, "internal error", Plan(stop=False))
            if self._stopped:
                return
            plan = outcome.plan
            if plan.log:
                level = logging.ERROR if plan.bug else logging.WARNING
                log.log(level, "%s%s", "client bug: " if plan.bug else "", plan.log)
            if plan.stop:
                self._stop(outcome.code, outcome.reason)
                return
            if plan.wait is Wait.REFRESH:
                self._refreshed = self._refresh_next = True
            self._url_index = self._next_url()
            delay = 0.0
            if not self._now:
                delay = wait_seconds(plan.wait, self._attempt, outcome.retry_after, self._rand)
                if plan.wait is not Wait.RESTART:
                    self._attempt += 1
            self._set_state("connecting")
            if outcome.report:
                info = Disconnected(outcome.code, outcome.reason, True, round(delay, 3))
                self._emit_lifecycle("disconnected", info)
            if self._now:
                self._now = False
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._now = False

    def _next_url(self) -> int:
        """Another address, picked at random: a node that failed or drained may not be
        back yet, and its clients spread over the others instead of all moving to one."""
        count = len(self._urls)
        if count == 1:
            return 0
        step = 1 + min(int(self._rand() * (count - 1)), count - 2)
        return (self._url_index + step) % count

    async def _attempt_once(self) -> _Outcome:
        try:
            token = await self._fetch_token()
        except Unauthorized as exc:
            return _Outcome(1008, f"unauthorized: {exc}", Plan(stop=True), report=False)
        except Exception as exc:
            log.warning("get_token failed, retrying: %r", exc)
            return _Outcome(1006, "token unavailable", Plan(stop=False), report=False)
        if token is None:
            return _Outcome(1008, "unauthorized: no token", Plan(stop=True), report=False)
        self._token = token
        if self._user_stream is None:
            sub = token_claims(token).get("sub")
            if isinstance(sub, str) and sub:
                self._user_stream = user_stream(sub)
        url = self._urls[self._url_index]
        try:
            ws = await connect(
                url,
                proxy=_proxy_for(url),
                open_timeout=self.connect_timeout,
                compression=None,
                subprotocols=[Subprotocol(MSGPACK_SUBPROTOCOL)] if self.binary else None,
                max_size=None,
                close_timeout=2,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            retry = _retry_after(exc.response.headers.get("Retry-After"))
            plan = connect_plan(status=status)
            return _Outcome(1006, f"HTTP {status}", plan, retry)
        except TimeoutError:
            plan = connect_plan(status=None, timed_out=True)
            return _Outcome(1006, "connect timeout", plan)
        except InvalidURI as exc:
            return _Outcome(1006, f"bad url: {exc}", Plan(stop=True), report=False)
        except (OSError, InvalidHandshake) as exc:
            return _Outcome(1006, f"cannot connect: {exc}", connect_plan(status=None))
        self._ws = ws
        self._last_error = None
        self._gave_up = None
        try:
            await self._send(self._subscribe_frame(token))
            await self._read(ws)
        finally:
            self._drop()
        if self._gave_up is not None:
            return _Outcome(1006, self._gave_up, Plan(stop=False))
        code = ws.close_code if ws.close_code is not None else 1006
        reason = ws.close_reason or ""
        plan = close_plan(code, opened=True, error=self._last_error, refreshed=self._refreshed)
        return _Outcome(code, reason, plan)

    async def _fetch_token(self) -> str | None:
        refresh, self._refresh_next = self._refresh_next, False
        if refresh:
            invalidate = getattr(self._get_token, "invalidate", None)
            if callable(invalidate):
                invalidate()
        try:
            got = (
                self._get_token(refresh=refresh) if self._token_takes_refresh else self._get_token()
            )
            if inspect.isawaitable(got):
                got = await got
        except Exception:
            self._refresh_next = refresh  # the refresh is still owed
            raise
        if got is not None and not isinstance(got, str):
            raise TokenUnavailable(f"get_token returned {type(got).__name__}, not a string")
        return got

    async def _read(self, ws: ClientConnection) -> None:
        """Read until the socket closes. A watchdog replaces it once it is silent for
        the subscribe's acknowledgement deadline, then for three heartbeats (none: the
        library's pings only). It is one timer that a frame only dates: re-arming a
        timer per frame costs more than reading the frame."""
        loop = asyncio.get_running_loop()
        heard = loop.time()
        armed_for: float | None = None
        timer: asyncio.TimerHandle | None = None

        def limit() -> float | None:
            return self.ack_timeout if self._subscribe_ack else self._read_seconds

        def arm(seconds: float | None) -> None:
            nonlocal timer, armed_for
            if timer is not None:
                timer.cancel()
            armed_for = seconds
            timer = None if seconds is None else loop.call_at(heard + seconds, check)

        def check() -> None:
            nonlocal timer
            timer = None
            seconds = limit()
            if self._ws is not ws or seconds is None:
                return
            if loop.time() < heard + seconds:
                timer = loop.call_at(heard + seconds, check)  # a frame came meanwhile
                return
            waiting_ack = self._subscribe_ack is not None
            self._give_up("subscribe not acknowledged" if waiting_ack else "read timeout")

        arm(limit())
        try:
            async for data in ws:
                heard = loop.time()
                try:
                    await self._receive(data)
                except Exception:
                    log.exception("a frame could not be handled")
                if self._ws is not ws:
                    return  # dropped: reconnect_now, the watchdog
                if limit() != armed_for:
                    arm(limit())  # the subscribe was acknowledged
        except ConnectionClosed:
            pass
        finally:
            if timer is not None:
                timer.cancel()

    def _subscribe_frame(self, token: str) -> str | bytes:
        self._subscribe_ack = f"s{next(self._ack_ids)}"
        self._held = list(self._desired)
        streams = [self._user_stream] if self._user_stream is not None else []
        streams += [game_stream(game_key(m, g)) for m, g in self._held]
        since = self._tracker.begin(streams[:MAX_SINCE_STREAMS])
        action = subscribe_action(
            token,
            games=self._held,
            since=since,
            ack_id=self._subscribe_ack,
            heartbeat=True,
            invisible=self.invisible,
            wants_presence=self.wants_presence,
        )
        return encode_action(action, binary=self.binary)

    async def _send(self, frame: str | bytes) -> None:
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(ConnectionClosed):
                await ws.send(frame)

    def _send_soon(self, frame: str | bytes) -> None:
        task = asyncio.create_task(self._send(frame))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _give_up(self, reason: str) -> None:
        """Drop the socket from this side (a silent socket, reconnect_now): no goodbye."""
        ws = self._ws
        if ws is None:
            return
        self._gave_up = reason
        log.warning("replacing the socket: %s", reason)
        ws.transport.abort()
        self._drop()

    def _drop(self) -> None:
        """Forget the socket and everything tied to it."""
        self._ws = None
        self._read_seconds = None
        self._subscribe_ack = None
        self._syncing = False
        if self._watch is not None:
            self._dispatch(self._tracker.drop(self._watch.added))
            self._watch = None
        self._dispatch(self._tracker.reset())

    def _stop(self, code: int, reason: str) -> None:
        self._stopped = True
        if self._ws is not None:
            self._give_up(reason)
        self._finish(Disconnected(code, reason, False), by_server=True)

    def _finish(self, info: Disconnected, *, by_server: bool) -> None:
        if by_server:
            self._stopped_by_server = info
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(ClientStopped(info))
        self._waiters = []
        self._set_state("disconnected")
        self._emit_lifecycle("disconnected", info)
        self._end_feeds()

    # --- frames ---------------------------------------------------------------

    async def _receive(self, data: str | bytes) -> None:
        try:
            message = parse_server_frame(data)
        except ProtocolError as exc:
            log.warning("unreadable frame from the server: %s", exc.message)
            return
        await self._handle(message)

    async def _handle(self, message: ClientBound) -> None:
        if isinstance(message, Heartbeat):
            return
        if isinstance(message, Positioned | Skip):
            frame = StreamFrame.of(message)
            if self._user_stream is None and stream_user(frame.stream) is not None:
                self._user_stream = frame.stream
            self._dispatch(self._tracker.frame(frame))
        elif isinstance(message, Recovered):
            self._dispatch(self._tracker.answer(message))
        elif isinstance(message, Ack):
            self._acked(message)
        elif isinstance(message, ErrorMessage):
            self._refused(message)
        elif isinstance(message, PresenceSnapshot | PresenceDelta):
            await self._presence(message)
        elif isinstance(message, PendingTurns):
            plies = message.plies or (None,) * len(message.games)
            candidates = list(zip(message.games, plies, strict=True))
            games = [
                {"meta": m, "id": g, **(ply_fields(ply) if ply else {})}
                for (m, g), ply in candidates
            ]
            self._deliver(Event("pendingTurns", {"games": games}), None, candidates)
        elif isinstance(message, GameEvent | UserEvent | AdminTest | UnknownFrame):
            verb = "test" if isinstance(message, AdminTest) else message.verb
            self._deliver(Event(verb, message.payload, batch=(message.payload,)), None)
        elif isinstance(message, ChatAck):
            payload = {"clientMsgId": message.client_msg_id, "timeStamp": message.time_stamp}
            self._deliver(Event("chatAck", payload, batch=(payload,)), None)

    async def _presence(self, message: PresenceSnapshot | PresenceDelta) -> None:
        presence, gap = apply_presence(self.presence, message)
        if isinstance(message, PresenceSnapshot):
            self._syncing = False
        if gap and not self._syncing:
            self._syncing = True
            await self._send(encode_action(sync_presence_action(), binary=self.binary))
        if presence is not None and presence != self.presence:
            self.presence = presence
            self._hand("connections", "connections", PresenceChange(presence, message), None)

    def _acked(self, ack: Ack) -> None:
        if ack.ack_id == self._subscribe_ack:
            self._subscribe_ack = None
            self._attempt = 0
            self._refreshed = False
            beat = ack.heartbeat_seconds
            self._read_seconds = self.read_timeout or (
                HEARTBEAT_READ_FACTOR * beat if beat else None
            )
            if self._state != "connected":
                self._set_state("connected")
                self._emit_lifecycle("connected", Connected())
        elif self._watch is not None and ack.ack_id == self._watch.ack_id:
            self._watch = None
        else:
            return
        self._sync_games()

    def _refused(self, error: ErrorMessage) -> None:
        self._last_error = error.code
        info = ServerError(error.code, error.message, error.ack_id, error.client_msg_id)
        self._emit_lifecycle("error", info)
        watch = self._watch
        if watch is not None and error.ack_id == watch.ack_id:
            # Refused as a whole: the server keeps the previous set, and so do we.
            self._watch = None
            self._dispatch(self._tracker.drop(watch.added))
            self._desired = self._held = watch.previous
            self._settle(GamesRefused(error.code, error.message))
        elif error.ack_id is not None and error.ack_id == self._subscribe_ack:
            if error.code == "too_many_games":
                self._desired, self._held = [], []  # subscribed with no games; the ack follows
                self._settle(GamesRefused(error.code, error.message))
            elif error.code == "invalid_message":
                log.error("client bug: the server refused the subscribe: %s", error.message)

    def _sync_games(self) -> None:
        if (
            _keys(self._desired) == _keys(self._held)
            and not self._watch
            and not self._subscribe_ack
        ):
            self._settle(None)
            return
        if self._state != "connected" or self._watch or self._subscribe_ack or self._ws is None:
            return
        ack_id = f"w{next(self._ack_ids)}"
        before = set(_keys(self._held))
        added = [game_stream(key) for key in _keys(self._desired) if key not in before]
        self._watch = _Watch(ack_id, self._held, added)
        self._held = list(self._desired)
        since = self._tracker.begin(added[:MAX_SINCE_STREAMS])
        action = watch_games_action(self._held, since=since, ack_id=ack_id)
        self._send_soon(encode_action(action, binary=self.binary))

    def _settle(self, error: Exception | None) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if waiter.done():
                continue
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    # --- handing events over --------------------------------------------------

    def _dispatch(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, Deliver):
                stream = out.event.stream
                assert stream is not None
                self._turns.changed(stream)
                turns: Sequence[Candidate] = ()
                if out.event.verb == "yourTurn" and out.event.game is not None:
                    turns = ((out.event.game, ply_of(out.event.payload)),)
                self._deliver(out.event, out.commit, turns)
            elif isinstance(out, Resync):
                info = out.info
                self._turns.changed(info.stream)
                self._hand("resync", info.stream, info, out.commit, args=(info.stream, info))
            elif isinstance(out, Report):
                self._hand("recovered", out.info.stream, out.info, out.commit)
            elif isinstance(out, Advance):
                self._turns.changed(out.stream)
                self._commits.expect(out.stream, out.commit, 0)
                self._settle_stream(out.stream)

    def _deliver(
        self, event: Event, commit: Position | None, turns: Sequence[Candidate] = ()
    ) -> None:
        source: TurnSource = "yourTurn" if event.stream else "pendingTurns"
        fresh = [
            Turn(meta, game_id, source, event, ply=ply)
            for (meta, game_id), ply in self._turns.offer(turns)
        ]
        game = event.game
        lane = game_stream(game_key(*game)) if game is not None else event.stream or event.verb
        self._hand(event.verb, lane, event, commit, turns=fresh)

    def _hand(
        self,
        verb: str,
        lane: str,
        value: AnyEvent,
        commit: Position | None,
        *,
        args: tuple[Any, ...] | None = None,
        turns: Sequence[Turn] = (),
    ) -> None:
        """Queue ``value`` for ``verb``'s handlers in ``lane``, its turns for the turn
        handlers in their games' lanes, and both for the iterators; ``commit`` (the
        value's stream) moves once every one of them is done."""
        jobs: list[tuple[str, str, list[Handler], tuple[Any, ...]]] = []
        handlers = self._handlers.get(verb)
        if handlers:
            jobs.append((lane, verb, list(handlers), args if args is not None else (value,)))
        turn_handlers = self._handlers.get("turn")
        if turn_handlers:
            for turn in turns:
                turn_lane = game_stream(game_key(turn.meta, turn.id))
                jobs.append((turn_lane, "turn", list(turn_handlers), (turn,)))
        event_feeds = list(self._events) if self._events else []
        turn_feeds = list(self._turn_feeds) if turns else []
        stream = _stream_of(value)
        ticket: Ticket | None = None
        if commit is not None and stream is not None:
            pending = len(jobs) + len(event_feeds) + len(turn_feeds) * len(turns)
            ticket = self._commits.expect(stream, commit, pending)
            if pending == 0:
                self._settle_stream(stream)
        for job_lane, job_verb, job_handlers, job_args in jobs:
            self._queue(job_lane, self._job(job_verb, job_handlers, job_args, ticket))
        for feed in event_feeds:
            feed.put(value, ticket)
        for turn in turns:
            for turn_feed in turn_feeds:
                turn_feed.put(turn, ticket)

    def _job(
        self, verb: str, handlers: list[Handler], args: tuple[Any, ...], ticket: Ticket | None
    ) -> Callable[[], Awaitable[None]]:
        async def job() -> None:
            try:
                await self._call_all(verb, handlers, args)
            finally:
                if ticket is not None:
                    self._release(ticket)

        return job

    def _emit_lifecycle(self, verb: str, value: AnyEvent) -> None:
        self._hand(verb, CLIENT_LANE, value, None, args=() if verb == "connected" else None)

    def _set_state(self, state: State) -> None:
        if state == self._state:
            return
        self._state = state
        waiters, self._state_waiters = self._state_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        handlers = list(self._handlers.get("state", ()))
        if handlers:
            self._queue(CLIENT_LANE, lambda: self._call_all("state", handlers, (state,)))

    def _queue(self, lane: str, job: Callable[[], Awaitable[None]]) -> None:
        jobs = self._lanes.get(lane)
        if jobs is not None:
            jobs.append(job)
            return
        self._lanes[lane] = deque([job])
        self._lane_tasks[lane] = asyncio.create_task(
            self._run_lane(lane), name=f"apclient lane {lane}"
        )

    async def _run_lane(self, lane: str) -> None:
        jobs = self._lanes[lane]
        try:
            while jobs:
                await jobs[0]()
                jobs.popleft()
        finally:
            if self._lanes.get(lane) is jobs:
                del self._lanes[lane]
                del self._lane_tasks[lane]

    async def _call_all(self, verb: str, handlers: list[Handler], args: tuple[Any, ...]) -> None:
        for handler in handlers:
            try:
                result = handler(*args)
                if inspect.isawaitable(result):
                    await result
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("a %r handler raised", verb)

    def _release(self, ticket: Ticket) -> None:
        if self._commits.release(ticket):
            self._save()

    def _settle_stream(self, stream: str) -> None:
        if self._commits.settle(stream):
            self._save()

    def _save(self) -> None:
        try:
            self._storage.save(self._commits.committed)
        except Exception:
            log.exception("positions could not be saved")

    def _end_feeds(self) -> None:
        for feed in list(self._events):
            feed.end()
        for turn_feed in list(self._turn_feeds):
            turn_feed.end()

    def _feed_done(self, feed: _Feed[Any]) -> None:
        self._events.discard(feed)
        self._turn_feeds.discard(feed)


def _stream_of(value: AnyEvent) -> str | None:
    if isinstance(value, Event | RecoveryInfo | ResyncInfo):
        return value.stream
    return None


@functools.lru_cache(maxsize=64)
def _proxy_for(url: str) -> str | None:
    """The proxy for ``url`` from the environment (``HTTPS_PROXY``, ``NO_PROXY``...),
    looked up once per address: websockets would walk ``os.environ`` on every
    connect, about as much CPU as the rest of a reconnect."""
    return get_proxy(parse_uri(url))


def _takes_refresh(get_token: Callable[..., Any]) -> bool:
    """Whether ``get_token`` has a ``refresh`` parameter (then it is passed by name)."""
    try:
        parameters = inspect.signature(get_token).parameters
    except (TypeError, ValueError):
        return False
    return "refresh" in parameters


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value is not None else 0.0
    except ValueError:
        return 0.0


def _clean(games: Iterable[GameRef]) -> list[GameRef]:
    """The refs the server accepts, each once (it would drop the others silently)."""
    seen: dict[str, GameRef] = {}
    for meta, game_id in games:
        if (
            isinstance(meta, str)
            and isinstance(game_id, str)
            and 0 < len(meta) <= MAX_GAME_FIELD_CHARS
            and 0 < len(game_id) <= MAX_GAME_FIELD_CHARS
            and "#" not in meta
        ):
            seen[game_key(meta, game_id)] = (meta, game_id)
    return list(seen.values())


def _keys(games: Iterable[GameRef]) -> list[str]:
    return sorted(game_key(m, g) for m, g in games)


def _retrieve(future: asyncio.Future[None]) -> None:
    # A refusal nobody awaited is reported by the error event, not as "never retrieved".
    if not future.cancelled():
        future.exception()
