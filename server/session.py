"""One socket's session: identity, watch set, and its bounded outbox.

The outbox is the transport's own write buffer plus what the kernel holds
for the socket: a frame is written by the end of the loop turn that sent it,
or within ``--write-delay-ms`` on a busy node, and a session whose unsent bytes
are over the limit is a slow consumer and is closed. No per-client queue or
task sits between an event and the socket. Every write to a client goes
through :func:`send_frame` (or :func:`send_frames`), so frames reach a socket
in the order the node sends them; the frames one socket gets before a flush
leave in one write (:class:`TurnWrites`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import uuid
from collections.abc import Iterable, Sequence

from websockets.asyncio.server import ServerConnection
from websockets.protocol import State

from protocol.codec import Frame, FrameRun
from protocol.errors import MSGPACK_SUBPROTOCOL, CloseCode, ErrorCode
from protocol.messages import Broadcast, ErrorMessage, GameKey, Subscribe
from server.runtime.metrics import Registry
from server.runtime.socket_buffers import kernel_send_capacity, kernel_unsent
from server.runtime.token_bucket import TokenBucket
from server.store.base import ConnectionRecord, ttl_from_now

log = logging.getLogger(__name__)

_ids = itertools.count()

HELD_FRAMES = 16
HELD_FRAME_BYTES = 16 * 1024
"""Within ``--write-delay-ms``, a socket's frames wait for the flush only while they
are fewer than these and each is at most this big: the outbox is checked once per
flush, so what waits unchecked stays under 256 KiB a socket."""

DRAIN_BATCH_SECONDS = 0.1
"""One batch of drain closes per this interval: 100 batches over the default 10 s."""


class Traffic:
    """A node's frame counts: plain attributes, added to on the fan-out path (once
    per batch) and on every parsed frame, read by the node's registry when scraped.
    It carries the node's :class:`TurnWrites` to every session."""

    __slots__ = (
        "flood_closes",
        "frames_parsed",
        "frames_sent",
        "slow_consumers",
        "socket_writes",
        "turn",
    )

    def __init__(self, registry: Registry, write_delay: float = 0.0) -> None:
        self.frames_sent = 0
        self.socket_writes = 0
        self.turn = TurnWrites(self, write_delay)
        self.frames_parsed = 0
        self.slow_consumers = 0
        self.flood_closes = 0
        registry.counter_func(
            "ap_frames_sent_total", "Frames written to client sockets", lambda: self.frames_sent
        )
        registry.counter_func(
            "ap_socket_writes_total",
            "Writes of frames to client sockets: the frames of one flush share one",
            lambda: self.socket_writes,
        )
        registry.counter_func(
            "ap_write_flushes_total",
            "Flushes of the frames waiting for client sockets",
            lambda: self.turn.flushes,
        )
        registry.counter_func(
            "ap_write_flushes_held_total",
            "Flushes that waited out --write-delay-ms because the node was still sending",
            lambda: self.turn.held,
        )
        registry.counter_func(
            "ap_slow_consumers_total",
            "Connections closed because their outbox overflowed",
            lambda: self.slow_consumers,
        )
        registry.counter_func(
            "ap_flood_closes_total",
            "Connections closed for sending frames faster than their credits",
            lambda: self.flood_closes,
        )
        registry.counter_func(
            "ap_frames_received_total",
            "WebSocket frames parsed from clients (data and control)",
            lambda: self.frames_parsed,
        )


class TurnWrites:
    """A node's pending frames, written together: one write per socket per flush.

    A client watching several games that publish in the same loop turn gets
    all their frames in one ``transport.write``, one system call, where a write
    per frame would cost one each; the bytes and their order are the same.
    The outbox check is made on a socket's first frame of the flush: nothing
    is written until then, so the later ones would find the same buffer.
    Whether the socket is still open is checked at the flush, once per socket.

    With a ``delay`` (``--write-delay-ms``), the flush first lets the loop take
    one more turn of input. If that turn sent no frames, the node has caught up
    and the flush comes at once: a node with spare CPU adds a turn, microseconds.
    If it sent more, the node is busy: the flush waits until ``delay`` after the
    first frame, and the frames of all those turns share each socket's write,
    one system call where there would be several. A frame answering a client's
    own request (:meth:`prompt`) does not wait: it leaves at the turn's end with
    the frames queued before it.
    """

    __slots__ = (
        "delay",
        "dirty",
        "due",
        "flushes",
        "held",
        "loop",
        "prompted",
        "prompts",
        "scheduled",
        "seen",
        "sends",
        "traffic",
    )

    def __init__(self, traffic: Traffic, delay: float = 0.0) -> None:
        self.traffic = traffic
        self.delay = delay
        self.dirty: list[Session] = []  # sessions with frames pending
        self.scheduled = False
        self.sends = 0  # send_frame calls that sent something
        self.seen = 0  # sends when the turn being watched began
        self.due = 0.0  # loop time by which a delayed flush comes
        self.prompts: list[Session] = []  # sessions whose frames leave at this turn's end
        self.prompted = False
        self.flushes = 0
        self.held = 0  # flushes that waited for ``due``: the delay at work
        # The node's loop, held from its first turn: asyncio.get_running_loop()
        # costs a getpid() system call on CPython 3.11.
        self.loop: asyncio.AbstractEventLoop | None = None

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        return loop

    def schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            loop = self._loop()
            if self.delay:
                self.due = loop.time() + self.delay
                loop.call_soon(self._watch_a_turn)
            else:
                loop.call_soon(self.flush)

    def _watch_a_turn(self) -> None:
        # The next turn: the check one turn later sees whether this one sent frames.
        self.seen = self.sends
        self._loop().call_soon(self._flush_unless_busy)

    def _flush_unless_busy(self) -> None:
        if self.sends == self.seen:
            self.flush()  # that turn sent nothing: caught up
        else:
            self.held += 1
            self._loop().call_at(self.due, self.flush)

    def prompt(self, session: Session) -> None:
        """Write ``session``'s pending frames at this turn's end, even within a delay."""
        if not self.delay:
            return  # every flush is at the turn's end
        self.prompts.append(session)
        if not self.prompted:
            self.prompted = True
            self._loop().call_soon(self._flush_prompts)

    def _flush_prompts(self) -> None:
        self.prompted = False
        prompts, self.prompts = self.prompts, []
        # They stay in ``dirty``: the flush finds nothing pending for them, or
        # only what came after.
        self.write(prompts)

    def flush(self) -> None:
        self.scheduled = False
        self.flushes += 1
        dirty, self.dirty = self.dirty, []
        self.write(dirty)

    def write(self, sessions: list[Session]) -> None:
        """Each open session's pending frames in one write; the flush, a prompt and a
        close all come here."""
        opened = State.OPEN
        writes = frames = 0
        for session in sessions:
            pending = session.pending
            if pending is None:
                continue  # written by its close, or already (a prompt)
            session.pending = None
            extra = session.extra_frames  # a FrameRun's frames beyond its first
            if extra:
                session.extra_frames = 0
            # ``_state`` is what websockets' ``Protocol.state`` property returns
            # (tests/test_websockets_internals.py): read without the property call.
            if session.protocol._state is not opened:
                continue  # closed meanwhile: no data may follow a close frame
            try:
                if isinstance(pending, bytes):
                    session.write(pending)
                    frames += 1
                else:
                    session.write(b"".join(pending))
                    frames += len(pending)
            except Exception:  # one broken transport must not strand the others' frames
                log.exception("write to %s failed", session)
                continue
            writes += 1
            frames += extra
        self.traffic.socket_writes += writes
        self.traffic.frames_sent += frames


class Session:
    """The server's view of one client connection."""

    __slots__ = (
        "acking",
        "binary",
        "close_task",
        "connection_id",
        "credits",
        "deadline",
        "extra_frames",
        "heard_at",
        "heartbeat",
        "invisible",
        "kernel_capacity",
        "kind",
        "pending",
        "pinged_at",
        "positions",
        "protocol",
        "recovering",
        "row_ttl",
        "sync_at",
        "sync_pending",
        "traffic",
        "turn",
        "unpaused_most",
        "user_id",
        "wants_presence",
        "watch_version",
        "watching",
        "write",
        "write_paused",
        "ws",
    )

    def __init__(
        self, ws: ServerConnection, credits: TokenBucket | None = None, *, traffic: Traffic
    ) -> None:
        if ws.protocol.extensions:
            # send_frame writes pre-framed bytes, valid only without extensions.
            raise ValueError("sessions do not support WebSocket extensions")
        self.ws = ws
        # Read once per frame on the fan-out path: held here, each is one load
        # from this object rather than a walk through the connection's.
        self.protocol = ws.protocol
        self.write = ws.transport.write
        self.connection_id = f"{uuid.uuid4().hex[:20]}{next(_ids):x}"
        self.binary = ws.subprotocol == MSGPACK_SUBPROTOCOL
        self.user_id: str | None = None
        self.kind = "human"  # or "bot": bots are not counted in presence
        self.invisible = False
        self.wants_presence = True
        self.watch_version: int | None = None
        self.watching: frozenset[GameKey] = frozenset()
        self.row_ttl = 0
        self.close_task: asyncio.Task[None] | None = None
        self.credits = credits  # frames this socket may still send (flood control)
        self.traffic = traffic  # its node's frame counts
        self.turn = traffic.turn  # where its frames wait for the next flush
        # Its frames waiting for the flush, if any: one frame's bytes alone (the common
        # case allocates no list), else a list of them.
        self.pending: bytes | list[bytes] | None = None
        self.extra_frames = 0  # frames pending beyond one per piece (a FrameRun is several)
        # Loop times of the last bytes read from it and of the last keepalive ping.
        self.heard_at = 0.0
        self.pinged_at = 0.0
        self.deadline: asyncio.TimerHandle | None = None  # closes it if it never subscribes
        self.sync_at = -1e9  # loop time of the last syncPresence answer
        self.sync_pending = False  # an answer is scheduled for the end of that second
        self.kernel_capacity = kernel_send_capacity(ws.transport)
        # The most it can have unsent while websockets has not paused writing (the
        # transport pauses it past its high-water mark): under the outbox limit,
        # an unpaused socket needs no check per turn.
        self.unpaused_most = ws.transport.get_write_buffer_limits()[1] + self.kernel_capacity
        # Whether that pause is on; True (check every turn) until its connection
        # mirrors the transport's pauses here (GuardedConnection.attach).
        self.write_paused = True
        # Stream speakers only (they sent ``since``): stream -> last (epoch, offset)
        # sent, so that replay and live never duplicate. None: a plain client.
        self.positions: dict[str, tuple[str, int]] | None = None
        # Streams being recovered -> live events buffered until the replay is sent.
        self.recovering: dict[str, list[tuple[str, int, Broadcast]]] = {}
        # The ``ackId`` of the action being handled: its error frames carry it.
        self.acking: str | None = None
        self.heartbeat = False  # asked for heartbeat frames in its subscribe

    @property
    def subscribed(self) -> bool:
        return self.user_id is not None

    @property
    def open(self) -> bool:
        """Its socket is open and no close has begun: work for it is not wasted."""
        return self.close_task is None and self.ws.protocol.state is State.OPEN

    @property
    def is_bot(self) -> bool:
        return self.kind == "bot"

    @property
    def speaks_streams(self) -> bool:
        return self.positions is not None

    @property
    def legacy(self) -> bool:
        """A client that never asked for targeted watch gets every game event."""
        return self.watch_version is None and not self.watching

    def send(self, frame: Frame, outbox_limit: int) -> None:
        """Write one frame at this turn's end, or close the session if it cannot keep up.

        A frame for one session answers it (an ack, an error, a snapshot): it
        does not wait out ``--write-delay-ms``."""
        if send_frame([self], frame, outbox_limit):
            self.turn.prompt(self)

    def send_error(
        self,
        code: ErrorCode,
        message: str,
        outbox_limit: int,
        client_msg_id: str | None = None,
    ) -> None:
        error = ErrorMessage(code, message, client_msg_id, self.acking)
        self.send(Frame(error), outbox_limit)

    def send_control(self, data: bytes) -> bool:
        """Write a control frame (``data``, framed) now; False once closing.

        A control frame may go between any two frames, so the frames waiting
        for the flush may follow it; it must not follow a close frame, which is never
        written while the session is open and not closing."""
        if self.close_task is not None or self.ws.protocol.state is not State.OPEN:
            return False
        self.ws.transport.write(data)  # not in ap_socket_writes_total: no frame of ours
        return True

    def write_pending(self) -> None:
        """Write the frames waiting for the flush now, ahead of a close frame that must
        come last."""
        self.turn.write([self])

    def close(self, code: CloseCode, reason: str) -> None:
        """Start the closing handshake without waiting for it."""
        if self.close_task is None:
            self.write_pending()
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None
            self.close_task = asyncio.create_task(self._close(code, reason))

    async def _close(self, code: CloseCode, reason: str) -> None:
        # ws.close() first waits for the write buffer to drain, which a client
        # that does not read never lets happen: bound the whole handshake.
        # The close frame is queued behind the unsent data, so a client that
        # reads again within --close-timeout still sees the code.
        ws = self.ws
        try:
            async with asyncio.timeout(ws.close_timeout):
                await ws.close(code, reason)
        except TimeoutError:
            ws.transport.abort()

    def unsent_bytes(self, outbox_limit: int) -> int:
        """Bytes written but not yet sent: user space, and the kernel's part when it matters.

        The kernel's share is read (``SIOCOUTQ``) only when it could tip the
        sum over ``outbox_limit``, so the common path costs no system call.
        """
        transport = self.ws.transport
        queued = transport.get_write_buffer_size()
        if queued + self.kernel_capacity <= outbox_limit:
            return queued
        return queued + kernel_unsent(transport, self.kernel_capacity)

    def over_limit(self, outbox_limit: int) -> bool:
        return self.unsent_bytes(outbox_limit) > outbox_limit

    def take_subscribe(
        self, user_id: str, kind: str, action: Subscribe, games: frozenset[GameKey]
    ) -> None:
        """Become ``user_id`` with what ``action`` asks (``games``: the watch set allowed)."""
        bot = kind == "bot"
        self.user_id = user_id
        self.kind = kind
        self.invisible = action.invisible
        # Bots get no presence unless they ask, and never fall back to legacy routing.
        wants = action.wants_presence
        self.wants_presence = wants if wants is not None else not bot
        self.watch_version = action.watch_version
        if bot and self.watch_version is None:
            self.watch_version = 1
        self.watching = games
        self.heartbeat = action.heartbeat
        self.row_ttl = ttl_from_now()
        if action.since is not None and self.positions is None:
            self.positions = {}

    def row(self, endpoint: str) -> ConnectionRecord:
        """This subscribed session's ``wsConnections`` row, on node ``endpoint``."""
        assert self.user_id is not None
        return ConnectionRecord(
            connection_id=self.connection_id,
            user_id=self.user_id,
            invisible=self.invisible,
            endpoint=endpoint,
            wants_presence=self.wants_presence,
            watch_version=self.watch_version,
            watching_games=self.watching,
            ttl=self.row_ttl,
        )

    def __repr__(self) -> str:
        return f"<Session {self.connection_id} user={self.user_id}>"


async def close_spread_out(
    sessions: Sequence[Session], seconds: float, code: CloseCode, reason: str
) -> None:
    """Close ``sessions`` over ``seconds`` in jittered batches, in a random order:
    closed all at once, their clients would all reconnect elsewhere in the same second."""
    if not sessions:
        return
    order = list(sessions)
    random.shuffle(order)
    batches = max(1, min(len(order), round(seconds / DRAIN_BATCH_SECONDS)))
    loop = asyncio.get_running_loop()
    started = loop.time()
    # Batch i closes at a random moment of the i-th slice of the window.
    moments = [started + seconds * (i + random.random()) / batches for i in range(batches)]
    log.info("draining %d sessions over %gs in %d batches", len(order), seconds, batches)
    for i, moment in enumerate(moments):
        await asyncio.sleep(max(0.0, moment - loop.time()))
        for session in order[i::batches]:
            session.close(code, reason)


async def wait_closed(sessions: Iterable[Session], within: float) -> None:
    """Return once every closing handshake of ``sessions`` is over, or after ``within`` s."""
    closing = [s.close_task for s in sessions if s.close_task is not None]
    if closing:
        await asyncio.wait(closing, timeout=within)


def send_frame(sessions: Iterable[Session], frame: Frame, outbox_limit: int) -> int:
    """Send ``frame`` to every session not closing; returns how many got it.

    The WebSocket frame is serialized once per format and its bytes join each
    session's frames waiting for the next flush (:class:`TurnWrites`;
    ``websockets.broadcast`` would frame the same bytes again per socket).
    Sessions whose outbox is over ``outbox_limit`` bytes are closed as slow
    consumers instead; nobody else waits for them. Every session belongs to
    one node, whose turn they join.

    This loop runs once per frame per recipient, the server's hottest: each
    line of it is worth measuring (``python -m loadtest fanout``).
    """
    sent = 0
    dirty: list[Session] | None = None
    text: bytes | None = None
    binary: bytes | None = None
    text_held = binary_held = held = True  # small enough to wait out a write delay
    for session in sessions:
        if session.binary:
            if binary is None:
                binary = frame.binary_wire
                binary_held = len(binary) <= HELD_FRAME_BYTES
            data = binary
            held = binary_held
        else:
            if text is None:
                text = frame.text_wire
                text_held = len(text) <= HELD_FRAME_BYTES
            data = text
            held = text_held
        pending = session.pending
        if pending is None:
            # Its first frame of this flush: the outbox is checked once per flush.
            if session.close_task is not None:
                continue
            suspect = session.write_paused or session.unpaused_most > outbox_limit
            if suspect and session.over_limit(outbox_limit):
                close_slow_consumer(session)
                continue
            if dirty is None:
                turn = session.turn
                turn.schedule()
                dirty = turn.dirty
            session.pending = data
            dirty.append(session)
        elif isinstance(pending, list):
            pending.append(data)
            if len(pending) == HELD_FRAMES:
                held = False
        else:
            session.pending = [pending, data]
        if not held:
            # What waits unchecked for the outbox stays small: big frames, or
            # many, leave at this turn's end.
            session.turn.prompt(session)
        sent += 1
    if sent:
        session.turn.sends += 1  # still sending: a delayed flush waits (TurnWrites)
    return sent


def send_frames(session: Session, frames: Sequence[Frame | FrameRun], outbox_limit: int) -> bool:
    """Send ``frames`` to one session, in order: with its other waiting frames,
    a replay of many events costs one system call rather than one per event.
    False when the session is closed or closing (as a slow consumer, if over
    ``outbox_limit``)."""
    if not frames:
        return True
    if not session.open:
        return False
    if session.binary:
        data = [frame.binary_wire for frame in frames]
    else:
        data = [frame.text_wire for frame in frames]
    extra = sum([frame.count for frame in frames]) - len(frames)
    pending = session.pending
    if pending is None:
        if session.over_limit(outbox_limit):
            close_slow_consumer(session)
            return False
        session.turn.dirty.append(session)
        session.turn.schedule()
    elif isinstance(pending, list):
        pending.extend(data)
        data = pending
    else:
        data.insert(0, pending)
    session.pending = data
    session.extra_frames += extra
    session.turn.prompt(session)  # a replay answers its session: it does not wait
    return True


def close_slow_consumer(session: Session) -> None:
    if session.close_task is None:
        session.traffic.slow_consumers += 1
        log.info(
            "closing slow consumer %s", session, extra={"connection_id": session.connection_id}
        )
        session.close(CloseCode.SLOW_CONSUMER, "slow consumer")
