"""Answering a client's ``since``: the events it missed, then ``recovered`` per stream.

A recovering session buffers the live events of each stream it recovers from
before the history read until its replay is written (``Session.recovering``),
so the switch from replay to live loses and duplicates nothing. What to send
is decided by :func:`protocol.streams.merge_recovery`; here are the reads, the
writes, and a cache of replayed frames shared by every client that missed the
same events.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from protocol.codec import Frame, FrameRun
from protocol.errors import ErrorCode
from protocol.messages import (
    Broadcast,
    GameEvent,
    Position,
    Positioned,
    Recovered,
    ServerMessage,
    Since,
    Skip,
    UserEvent,
)
from protocol.streams import (
    HistoryRead,
    RecoveryAnswer,
    answer_recovery,
    game_stream,
    stream_game,
    stream_user,
    user_stream,
)
from server.routing.history_reads import HistoryReads
from server.routing.subscribe_batching import SubscribeBatcher
from server.runtime.metrics import Registry
from server.session import Session, send_frames

log = logging.getLogger(__name__)

REPLAY_FRAME_CACHE = 16384
"""Replayed frames (and ``recovered: true`` answers) kept, least recently used
out, for other clients recovering the same events: a storm over 1,000 games
with 10 missed events each replays 10,000 distinct frames (about 1 KB each)."""

REPLAY_RUN_FRAMES = 16384
"""Frames in the whole replays kept (each a stream's events after one position,
then ``recovered``), least recently used out: as many as ``REPLAY_FRAME_CACHE``,
so their joined bytes take about what the cached frames do. A storm over 1,000
games with 10 missed events each keeps 11,000."""


class ReplayRun(NamedTuple):
    frames: FrameRun
    excluded: frozenset[str]
    """Users excluded from one of its events: theirs has a ``skip`` there instead."""


Held = Callable[[str, str, int], None]
"""Told each stream's answer ``(stream, epoch, top)``: the node tracks the
stream from there (``StreamDelivery.hold``)."""


class Recovery:
    def __init__(
        self,
        history: HistoryReads,
        subscribes: SubscribeBatcher,
        outbox_limit: int,
        metrics: Registry,
        held: Held = lambda stream, epoch, top: None,
    ) -> None:
        self._recoveries = metrics.counter(
            "ap_stream_recoveries_total", "Client recoveries answered"
        )
        self._recoveries_failed = metrics.counter(
            "ap_stream_recoveries_failed_total", "Client recoveries answered with recovered:false"
        )
        self._history = history
        self._held = held
        # Every subscribe a recovery waits for goes out in batches, so a storm's are a few calls.
        self._subscribes = subscribes
        self._outbox_limit = outbox_limit
        # Replayed frames, shared by every client recovering the same events.
        self._replay_frames: OrderedDict[tuple[str, str, int, str], Frame] = OrderedDict()
        # Whole replays, shared by every client recovering a stream from the same position.
        self._replay_runs: OrderedDict[tuple[str, str, int, int], ReplayRun] = OrderedDict()
        self._run_frames = 0  # frames in the replays kept

    async def close(self) -> None:
        await self._subscribes.close()

    async def recover(self, session: Session, since: Since) -> None:
        """Answer ``since``: per entitled stream, the missed events then ``recovered``.

        The session buffers live events of a stream from before the history
        read until its replay is sent (in one loop turn, with the buffer), so
        the switch from replay to live loses and duplicates nothing.
        """
        wanted: list[tuple[str, Position]] = []
        for stream, position in since.items():
            if _entitled(session, stream):
                session.recovering[stream] = []
                wanted.append((stream, position))
            else:
                session.send_error(
                    ErrorCode.STREAM_NOT_ALLOWED,
                    f"not entitled to stream {stream[:80]!r}: watch the game first, "
                    "or name your own user stream",
                    self._outbox_limit,
                )
        # Hear every stream of the session before answering, and before reading
        # any history: then history and live together cover everything
        # (docs/protocol.md, "Recovery"), and a stream speaker's next request is
        # handled only once its live streams are in place.
        assert session.user_id is not None
        streams = {game_stream(key) for key in session.watching}
        streams.add(user_stream(session.user_id))
        try:
            await self._subscribes.subscribe(streams)
        except Exception as exc:
            log.warning("subscribe before recovery failed: %s", exc)
        if not wanted:
            return
        if not session.open:
            return self._abandon(session, wanted)  # its client gave up meanwhile
        reads: Sequence[HistoryRead[Broadcast] | BaseException | None]
        reads = await self._history.read_each([(s, position.offset) for s, position in wanted])
        if any(isinstance(read, Exception) for read in reads):
            # Redis away (a restart, a failover): an answer now could only guess
            # the epoch and top. The tab's live events keep buffering meanwhile.
            reads = list(reads)
            for index, (stream, position) in enumerate(wanted):
                if isinstance(reads[index], Exception):
                    reads[index] = await self._history.read_patiently(stream, position.offset)
        if not session.open:
            return self._abandon(session, wanted)
        # Every stream's answer in one write: one system call per client, not per event.
        # Nothing is awaited until it is written, so no live event comes between.
        out: list[Frame | FrameRun] = []
        for (stream, position), history in zip(wanted, reads, strict=True):
            buffered = session.recovering.pop(stream, None)
            if buffered is None:
                continue  # the session stopped watching meanwhile
            self._answer(session, stream, position, history, buffered, out)
        send_frames(session, out, self._outbox_limit)

    @staticmethod
    def _abandon(session: Session, wanted: Sequence[tuple[str, Position]]) -> None:
        """Nothing more for a session that closed: its socket cannot take an answer."""
        for stream, _ in wanted:
            session.recovering.pop(stream, None)

    def _answer(
        self,
        session: Session,
        stream: str,
        since: Position,
        history: HistoryRead[Broadcast] | BaseException | None,
        buffered: list[tuple[str, int, Broadcast]],
        out: list[Frame | FrameRun],
    ) -> None:
        self._recoveries.inc()
        positions = session.positions
        assert positions is not None
        if isinstance(history, BaseException) or history is None:
            log.warning("history of %s unreadable during recovery: %s", stream, history)
            answer = answer_recovery(since, None, buffered)
        else:
            answer = answer_recovery(since, history, buffered)
            self._held(stream, answer.epoch, answer.offset)
        epoch, offset = answer.epoch, answer.offset
        if answer.recovered:
            # What every client recovering from the same position gets: joined once.
            run = self._replay_run(stream, since.offset, answer)
            if session.user_id not in run.excluded:
                out.append(run.frames)
                positions[stream] = (epoch, offset)
                return
        user_id = session.user_id
        for event_offset, message in answer.replay:
            out.append(self._event_frame(user_id, stream, epoch, event_offset, message))
        if answer.recovered:
            recovered = Recovered(stream, True, epoch, offset)
            out.append(self._replay_frame((stream, epoch, offset, "recovered"), lambda: recovered))
        else:
            self._recoveries_failed.inc()
            out.append(Frame(Recovered(stream, False, epoch, offset)))
        positions[stream] = (epoch, offset)
        for event_offset, message in answer.live:
            out.append(self._event_frame(user_id, stream, epoch, event_offset, message))
            positions[stream] = (epoch, event_offset)

    def _event_frame(
        self, user_id: str | None, stream: str, epoch: str, offset: int, message: Broadcast
    ) -> Frame:
        """The frame of one replayed or buffered event for ``user_id``: a ``skip``
        where the event excludes the user, else the event at its position."""
        if user_id in message.exclude:
            key = (stream, epoch, offset, "skip")
            return self._replay_frame(key, lambda: Skip(stream, epoch, offset))
        event = message.event
        assert isinstance(event, GameEvent | UserEvent)
        key = (stream, epoch, offset, "event")
        return self._replay_frame(key, lambda: Positioned(event, stream, epoch, offset))

    def _replay_run(self, stream: str, after: int, answer: RecoveryAnswer[Broadcast]) -> ReplayRun:
        """The replay of ``stream`` after ``after`` up to the answer's top, then
        ``recovered: true``, as sent to a client excluded from none of its events:
        the events of a stream's epoch up to an offset never change, so the run
        is the same for every such client recovering from the same position."""
        key = (stream, answer.epoch, after, answer.offset)
        runs = self._replay_runs
        run = runs.get(key)
        if run is not None:
            runs.move_to_end(key)
            return run
        epoch, top = answer.epoch, answer.offset
        frames = [self._event_frame(None, stream, epoch, o, m) for o, m in answer.replay]
        recovered = Recovered(stream, True, epoch, top)
        frames.append(self._replay_frame((stream, epoch, top, "recovered"), lambda: recovered))
        excluded = frozenset(user for _, message in answer.replay for user in message.exclude)
        run = runs[key] = ReplayRun(FrameRun(frames), excluded)
        self._run_frames += run.frames.count
        while self._run_frames > REPLAY_RUN_FRAMES and len(runs) > 1:
            _, oldest = runs.popitem(last=False)
            self._run_frames -= oldest.frames.count
        return run

    def _replay_frame(
        self, key: tuple[str, str, int, str], build: Callable[[], ServerMessage]
    ) -> Frame:
        """The frame for ``key`` from the cache, or built and kept: the replay's
        frames are the same for every client that missed the same events."""
        frames = self._replay_frames
        frame = frames.get(key)
        if frame is not None:
            frames.move_to_end(key)
            return frame
        frame = frames[key] = Frame(build())
        if len(frames) > REPLAY_FRAME_CACHE:
            frames.popitem(last=False)
        return frame


def _entitled(session: Session, stream: str) -> bool:
    game = stream_game(stream)
    if game is not None:
        return game in session.watching
    return stream_user(stream) == session.user_id
