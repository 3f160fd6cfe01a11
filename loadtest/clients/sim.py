"""Simulated browsers and bots on a lean WebSocket client.

Each :class:`SimClient` is an ``asyncio.Protocol`` that speaks RFC 6455 itself:
an HTTP upgrade, masked client frames, unmasked server frames. It skips the
per-message queues and futures of a general-purpose client, so one generator
process can hold thousands of sockets and read a hundred thousand frames a
second without becoming the bottleneck it is meant to measure around.

Above the framing it follows the live browser client's rules
(``abstractplay-realtime-today.md``):

- on open, ``subscribe`` with ``watchVersion: 1``, its ``invisible`` flag and
  its games, then ``watchGames`` at once, after 250 ms and after 1 s, and
  ``syncPresence`` every 10 minutes;
- a presence snapshot replaces the state; a delta with ``seq <= last`` is
  ignored; a delta with ``seq > last + 1`` is a gap, answered with
  ``syncPresence``; otherwise leaves then joins are applied and
  ``totalCount += joins - leaves``;
- on ``game`` or ``chat`` it would refetch: here it records the latency from
  the publish timestamp in the payload.

A bot subscribes with ``wantsPresence: false`` and its games, and only
watches them.

A client that speaks streams (``ClientSpec.streams``) also keeps, per stream,
the last ``(epoch, offset)`` it saw, in a :class:`StreamBook` that outlives
the connection. It subscribes with ``since`` (``{}`` the first time), checks
that each stream's offsets arrive exactly one apart (``skip`` frames count as
positions), and counts every duplicate, hole and ``recovered`` answer.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import random
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from loadtest.report.stats import Histogram

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_FRAME = 16 * 1024 * 1024
WATCH_REPEATS = (0.25, 1.0)  # the browser re-sends watchGames after these delays
SYNC_INTERVAL = 600.0  # and asks for a fresh snapshot every 10 minutes

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA

_GAME_PREFIXES = (b'{"verb":"game"', b'{"verb":"chat"')
_TS = re.compile(rb'"ts":(\d+),"ph":(\d+)')
_TS_SEARCH = _TS.search
_SNAPSHOT = re.compile(
    rb'\{"verb":"connections","payload":\{"type":"snapshot","seq":(\d+),"totalCount":(\d+),'
)
_DELTA_PREFIX = b'{"verb":"connections","payload":{"type":"delta"'
_DELTA = re.compile(
    rb'\{"verb":"connections","payload":\{"type":"delta","seq":(\d+),'
    rb'"joins":\[([^\]]*)\],"leaves":\[([^\]]*)\],"totalCount":(\d+)\}\}$'
)
_SNAPSHOT_PREFIX = b'{"verb":"connections","payload":{"type":"snapshot"'
# Stream positions sit at the top level of a frame, beside verb and payload;
# the load test's payloads never use these names, so a search finds them.
_VERB = re.compile(rb'"verb":"([A-Za-z]+)"')
_STREAM = re.compile(rb'"stream":"([^"\\]*)"')
_EPOCH = re.compile(rb'"epoch":"([^"\\]*)"')
_OFFSET = re.compile(rb'"offset":(\d+)')
_STREAM_VERBS = (b"game", b"chat", b"skip")


class HandshakeError(Exception):
    """The server did not upgrade the connection to a WebSocket.

    ``status``: the HTTP status it answered instead (503: shed by admission),
    0 when the connection ended before any status line."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """Who one simulated client is and what it watches."""

    user_id: str
    bot: bool = False
    games: tuple[tuple[str, str], ...] = ()
    track: bool = False
    """Record each presence delta's arrival per seq (presence observers)."""
    full: bool = False
    """Keep the whole visible set, so the state can be checked against a snapshot."""
    quiet: bool = False
    """Read frames without interpreting them (churn users)."""
    invisible: bool = False
    streams: bool = False
    """Speak streams: subscribe with ``since`` and check every position."""


class StreamBook:
    """What a stream-speaking client knows, kept across its reconnects.

    ``positions`` maps a stream to the last ``[epoch, offset]`` seen. ``expect``
    is how many ``recovered`` answers the current connection waits for.
    """

    __slots__ = ("expect", "got", "positions", "recovered_ns")

    def __init__(self) -> None:
        self.positions: dict[str, list[Any]] = {}
        self.expect = 0
        self.got = 0
        self.recovered_ns = 0
        """When a connection last had every stream answered (0: not since the reset)."""

    def since(self) -> dict[str, dict[str, Any]]:
        # -1 (told to refetch, top unknown) is "nothing of this epoch yet": offset 0.
        return {s: {"epoch": e, "offset": max(o, 0)} for s, (e, o) in self.positions.items()}


@dataclass(slots=True)
class SeqRecord:
    """One presence delta as every tracked observer of a worker received it."""

    joins: list[str]
    leaves: list[str]
    arrivals: list[int] = field(default_factory=list)


class Tally:
    """Everything a worker's clients count; ticks copy the counters to the parent."""

    COUNTERS = (
        "connected",
        "subscribed",
        "connect_failures",
        "connect_refused",
        "connect_reset",
        "connect_timeouts_tcp",
        "connect_timeouts_handshake",
        "connect_shed",
        "connect_other",
        "dropped",
        "reconnects",
        "gave_up",
        "frames",
        "game_events",
        "snapshots",
        "deltas",
        "gaps",
        "resyncs",
        "stale_deltas",
        "total_mismatches",
        "errors",
        "verified",
        "state_mismatches",
        "stream_events",
        "stream_first",
        "skips",
        "duplicates",
        "holes",
        "lost",
        "epoch_changes",
        "recovered",
        "not_recovered",
        "recovered_short",
        "recovery_done",
        "clients_recovered",
        "unpositioned",
    )

    def __init__(self) -> None:
        self.connected = 0
        self.subscribed = 0
        self.connect_failures = 0
        """Connect attempts that did not end in an open WebSocket; by cause:"""
        self.connect_refused = 0
        """the kernel refused the TCP connect (no listener, or a full accept queue)"""
        self.connect_reset = 0
        """reset or closed before the handshake's answer (a dropped SYN queue entry too)"""
        self.connect_timeouts_tcp = 0
        """no TCP connection within --connect-timeout (SYNs or the final ACK dropped)"""
        self.connect_timeouts_handshake = 0
        """connected, but no upgrade answer within --connect-timeout (the server busy)"""
        self.connect_shed = 0
        """HTTP 503 from the server's admission (node cap or accept rate)"""
        self.connect_other = 0
        """any other handshake failure"""
        self.dropped = 0
        self.reconnects = 0
        self.gave_up = 0
        """Clients that stopped trying after MAX_RECONNECTS failed attempts in a row."""
        self.frames = 0
        self.game_events = 0
        self.snapshots = 0
        self.deltas = 0
        self.gaps = 0
        self.resyncs = 0
        self.stale_deltas = 0
        self.total_mismatches = 0
        self.errors = 0
        self.verified = 0
        self.state_mismatches = 0
        self.stream_events = 0
        """Events and skips read with a position, live or replayed."""
        self.stream_first = 0
        """Positions seen on a stream the client had none for (no check possible)."""
        self.skips = 0
        self.duplicates = 0
        """Positions at or below the last one seen in the same epoch."""
        self.holes = 0
        self.lost = 0
        """Positions jumped over: the sum of every hole's width."""
        self.epoch_changes = 0
        self.recovered = 0
        self.not_recovered = 0
        self.recovered_short = 0
        """``recovered: true`` while the client's position was below the top."""
        self.recovery_done = 0
        """Connections that got an answer for every stream named in ``since``."""
        self.clients_recovered = 0
        """Clients (not connections) that did, once each since their books' reset."""
        self.unpositioned = 0
        """Stream frames without a position (a server that does not speak streams)."""
        self.recovered_ns: list[int] = []
        self.latency: dict[int, Histogram] = {}
        self.seqs: dict[int, SeqRecord] = {}
        self.first_snapshot_ns: list[int] = []
        self.error_samples: list[str] = []

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.COUNTERS}

    def game_event(self, sent_ns: int, phase: int, now_ns: int) -> None:
        self.game_events += 1
        histogram = self.latency.get(phase)
        if histogram is None:
            histogram = self.latency[phase] = Histogram()
        histogram.record((now_ns - sent_ns) // 1000)

    def error(self, data: bytes) -> None:
        self.errors += 1
        if len(self.error_samples) < 20:
            self.error_samples.append(data[:200].decode("utf-8", "replace"))


def accept_key(key: bytes) -> bytes:
    """``Sec-WebSocket-Accept`` for a ``Sec-WebSocket-Key``."""
    return base64.b64encode(hashlib.sha1(key + WS_GUID).digest())


def encode_frame(opcode: int, payload: bytes) -> bytes:
    """One final, masked client frame."""
    length = len(payload)
    if length < 126:
        header = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
    elif length < 65536:
        header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
    mask = os.urandom(4)
    if length:
        repeated = (mask * (length // 4 + 1))[:length]
        payload = (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(
            length, "big"
        )
    return header + mask + payload


LostCallback = Callable[["SimClient", int | None], None]


class SimClient(asyncio.Protocol):
    """One simulated browser or bot on its own TCP connection."""

    def __init__(
        self,
        spec: ClientSpec,
        token: str,
        host: str,
        port: int,
        tally: Tally,
        on_lost: LostCallback | None = None,
        book: StreamBook | None = None,
    ) -> None:
        self.spec = spec
        self.book = book if book is not None or not spec.streams else StreamBook()
        self.token = token
        self.host = host
        self.port = port
        self.tally = tally
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.is_open = False
        self.closing = False  # we started the close: not a drop
        self.ended = False  # torn down: counted closed, timers cancelled, deaf
        self.close_code: int | None = None
        self.started_ns = 0
        self.subscribed_ns = 0
        self.action_ns = 0  # when subscribe was written
        self._key = base64.b64encode(os.urandom(16))
        self._buffer = b""
        self._need = 0
        self._fragments: list[bytes] = []
        self._timers: list[asyncio.TimerHandle] = []
        # presence state, as the browser keeps it
        self.seq: int | None = None
        self.total = 0
        self.visible: set[str] = set()
        self.verifying = False

    # --- transport ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        request = (
            f"GET / HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {self._key.decode()}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        )
        self.transport.write(request.encode())

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone(exc)

    def _gone(self, exc: Exception | None) -> None:
        """The connection's end, counted once: from ``connection_lost``, or from
        :meth:`abort` when the transport may never call it."""
        if self.ended:
            return
        self.ended = True
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        was_open = self.is_open
        self.is_open = False
        if not self.opened.done():
            self.opened.set_exception(
                HandshakeError(f"closed during the handshake: {exc}" if exc else "closed")
            )
            self.opened.exception()  # retrieved: the connect path reports it
        if was_open:
            self.tally.connected -= 1
            if not self.closing:
                self.tally.dropped += 1
            if self.on_lost is not None:
                self.on_lost(self, self.close_code)

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return
        now = time.time_ns()
        if self._buffer:
            data = self._buffer + data
            if len(data) < self._need:
                self._buffer = data
                return
            self._buffer = b""
        if not self.is_open:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > 16384:
                    self._fail(HandshakeError("handshake response too long"))
                    return
                self._buffer = data
                return
            try:
                self._check_handshake(data[:end])
            except HandshakeError as exc:
                self._fail(exc)
                return
            data = data[end + 4 :]
            self._on_open()
        self._need = 0
        size = len(data)
        pos = 0
        tally = self.tally
        while size - pos >= 2:
            first = data[pos]
            length = data[pos + 1]
            if first == 0x81 and length < 126:
                # the hot path: a short, final text frame, most often a game event
                start = pos + 2
                end = start + length
                if end > size:
                    self._need = end - pos
                    break
                if self.book is None and data.startswith(_GAME_PREFIXES, start, end):
                    tally.frames += 1
                    match = _TS_SEARCH(data, start, end)
                    if match is None:
                        tally.game_events += 1
                    else:
                        tally.game_event(int(match[1]), int(match[2]), now)
                else:
                    self._message(data[start:end], now)
                pos = end
                continue
            if length & 0x80:
                self._fail(HandshakeError("the server sent a masked frame"))
                return
            header = 2
            if length == 126:
                if size - pos < 4:
                    break
                length = (data[pos + 2] << 8) | data[pos + 3]
                header = 4
            elif length == 127:
                if size - pos < 10:
                    break
                length = int.from_bytes(data[pos + 2 : pos + 10], "big")
                header = 10
                if length > MAX_FRAME:
                    self._fail(HandshakeError("frame too large"))
                    return
            end = pos + header + length
            if end > size:
                self._need = end - pos
                break
            self._frame(first, data[pos + header : end], now)
            pos = end
        if pos < size:
            self._buffer = data[pos:]

    def _check_handshake(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or status[1] != b"101":
            code = int(status[1]) if len(status) >= 2 and status[1].isdigit() else 0
            raise HandshakeError(lines[0].decode("latin-1"), code)
        accept = b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"sec-websocket-accept":
                accept = value.strip()
        if accept != accept_key(self._key):
            raise HandshakeError("wrong Sec-WebSocket-Accept")

    def _fail(self, exc: Exception) -> None:
        if not self.opened.done():
            self.opened.set_exception(exc)
            self.opened.exception()
        if self.transport is not None:
            self.transport.abort()

    def send_text(self, text: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_frame(OP_TEXT, text.encode()))

    def send_json(self, message: dict[str, Any]) -> None:
        self.send_text(json.dumps(message, separators=(",", ":")))

    def close(self, code: int = 1000) -> None:
        """Close like a browser: a close frame, then the end of the stream."""
        self.closing = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(encode_frame(OP_CLOSE, struct.pack("!H", code)))
        transport.close()

    def abort(self) -> None:
        """Drop the connection at once (teardown, failed connects), and end the client now.

        Ended here, not in ``connection_lost``: when uvloop's ``create_connection``
        is cancelled after ``connection_made`` (a connect timeout that fires while
        the loop was busy), it closes the socket without ever calling
        ``connection_lost``. A client that had read its 101 meanwhile would stay
        open in the counts, its timers writing to a closed handle.
        """
        self.closing = True
        if self.transport is not None:
            self.transport.abort()
        self._gone(None)

    def _frame(self, first: int, payload: bytes, now: int) -> None:
        opcode = first & 0x0F
        if opcode in (OP_TEXT, OP_BINARY):
            if first & 0x80:
                self._message(payload, now)
            else:
                self._fragments = [payload]
        elif opcode == OP_CONT:
            self._fragments.append(payload)
            if first & 0x80:
                message = b"".join(self._fragments)
                self._fragments = []
                self._message(message, now)
        elif opcode == OP_PING:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(encode_frame(OP_PONG, payload))
        elif opcode == OP_CLOSE:
            self.close_code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(encode_frame(OP_CLOSE, payload[:2]))
                transport.close()

    # --- the browser's rules ------------------------------------------------

    def _on_open(self) -> None:
        self.is_open = True
        self.tally.connected += 1
        spec = self.spec
        games = [{"meta": meta, "id": game_id} for meta, game_id in spec.games]
        subscribe: dict[str, Any] = {
            "action": "subscribe",
            "token": self.token,
            "invisible": spec.invisible,
            "watchVersion": 1,
            "games": games,
        }
        if spec.bot:
            subscribe["wantsPresence"] = False
        if self.book is not None:
            since = self.book.since()
            subscribe["since"] = since
            self.book.expect = len(since)
            self.book.got = 0
        self.send_json(subscribe)
        self.action_ns = time.time_ns()
        if spec.bot:
            self.subscribed_ns = self.action_ns
            self.tally.subscribed += 1
        else:
            watch = json.dumps({"action": "watchGames", "games": games}, separators=(",", ":"))
            self.send_text(watch)
            loop = asyncio.get_running_loop()
            for delay in WATCH_REPEATS:
                self._timers.append(loop.call_later(delay, self.send_text, watch))
            # every 10 minutes while visible; the phase is spread like real tabs
            self._timers.append(
                loop.call_later(SYNC_INTERVAL * (0.5 + random.random()), self._periodic_sync)
            )
        if not self.opened.done():
            self.opened.set_result(None)

    def _periodic_sync(self) -> None:
        self.sync_presence()
        loop = asyncio.get_running_loop()
        self._timers.append(loop.call_later(SYNC_INTERVAL, self._periodic_sync))

    def sync_presence(self) -> None:
        self.send_text('{"action":"syncPresence"}')

    def _message(self, data: bytes, now: int) -> None:
        tally = self.tally
        tally.frames += 1
        if self.book is not None and self._stream_message(data, now):
            return
        if data.startswith(_GAME_PREFIXES):
            match = _TS.search(data)
            if match is not None:
                tally.game_event(int(match[1]), int(match[2]), now)
            else:
                tally.game_events += 1
            return
        if self.spec.quiet:
            if self.subscribed_ns == 0 and data.startswith(_SNAPSHOT_PREFIX):
                self._first_snapshot(now)
            return
        if data.startswith(_DELTA_PREFIX):
            self._delta(data, now)
        elif data.startswith(_SNAPSHOT_PREFIX):
            self._snapshot(data, now)
        elif data.startswith(b'{"verb":"error"'):
            tally.error(data)

    def _first_snapshot(self, now: int) -> None:
        self.subscribed_ns = now
        self.tally.subscribed += 1
        self.tally.first_snapshot_ns.append(now)

    def _snapshot(self, data: bytes, now: int) -> None:
        tally = self.tally
        tally.snapshots += 1
        visible: set[str] | None = None
        match = _SNAPSHOT.match(data)
        if match is not None and not self.spec.full:
            seq, total = int(match[1]), int(match[2])
        else:
            payload = json.loads(data)["payload"]
            seq, total = int(payload["seq"]), int(payload["totalCount"])
            visible = set(payload["visibleUserIds"])
        if self.verifying and visible is not None and seq == self.seq:
            self.verifying = False
            tally.verified += 1
            if visible != self.visible or total != self.total:
                tally.state_mismatches += 1
        # A snapshot replaces the state.
        self.seq = seq
        self.total = total
        if visible is not None:
            self.visible = visible
        if self.subscribed_ns == 0:
            self._first_snapshot(now)

    def _delta(self, data: bytes, now: int) -> None:
        tally = self.tally
        tally.deltas += 1
        joins: list[str] | None = None
        leaves: list[str] | None = None
        # Most observers only need the seq and the counts: read them without
        # building the lists (ids holding quotes, brackets or escapes fall back).
        match = _DELTA.match(data)
        if match is not None and b"\\" not in data:
            seq = int(match[1])
            joined = match[2].count(b'"') // 2
            left = match[3].count(b'"') // 2
            reported: int | None = int(match[4])
        else:
            payload = json.loads(data)["payload"]
            seq = int(payload["seq"])
            joins, leaves = payload["joins"], payload["leaves"]
            joined, left = len(joins), len(leaves)
            value = payload.get("totalCount")
            reported = value if isinstance(value, int) else None
        last = self.seq
        if last is None or seq <= last:
            tally.stale_deltas += 1
            return
        if seq > last + 1:
            tally.gaps += 1
            tally.resyncs += 1
            self.sync_presence()
            return
        # Apply: leaves, then joins, and totalCount += joins - leaves.
        self.seq = seq
        self.total += joined - left
        if reported is not None and reported != self.total:
            tally.total_mismatches += 1
        spec = self.spec
        if not (spec.full or spec.track):
            return
        record = tally.seqs.get(seq) if spec.track else None
        if joins is None and (spec.full or (spec.track and record is None)):
            payload = json.loads(data)["payload"]
            joins, leaves = payload["joins"], payload["leaves"]
        if spec.full:
            assert joins is not None and leaves is not None
            self.visible.difference_update(leaves)
            self.visible.update(joins)
        if spec.track:
            if record is None:
                assert joins is not None and leaves is not None
                record = tally.seqs[seq] = SeqRecord(joins=joins, leaves=leaves)
            record.arrivals.append(now)

    # --- streams ------------------------------------------------------------

    def _stream_message(self, data: bytes, now: int) -> bool:
        """Track a frame's stream position; True if the frame was a stream frame."""
        verb = _VERB.search(data)
        if verb is None:
            return False
        name = verb[1]
        if name == b"recovered":
            self._recovered(data, now)
            return True
        if name not in _STREAM_VERBS:
            return False
        tally = self.tally
        if name == b"skip":
            tally.skips += 1
        else:
            match = _TS.search(data)
            if match is not None:
                tally.game_event(int(match[1]), int(match[2]), now)
            else:
                tally.game_events += 1
        stream, epoch, offset = _STREAM.search(data), _EPOCH.search(data), _OFFSET.search(data)
        if stream is None or epoch is None or offset is None:
            tally.unpositioned += 1
            return True
        self._advance(stream[1].decode(), epoch[1].decode(), int(offset[1]))
        return True

    def _advance(self, stream: str, epoch: str, offset: int) -> None:
        """Check one position against the last one seen on its stream."""
        assert self.book is not None
        tally = self.tally
        tally.stream_events += 1
        position = self.book.positions.get(stream)
        if position is None:
            tally.stream_first += 1
            self.book.positions[stream] = [epoch, offset]
            return
        if position[1] < 0:
            pass  # refetched after recovered:false with no known top: anything goes
        elif position[0] != epoch:
            tally.epoch_changes += 1
        elif offset <= position[1]:
            tally.duplicates += 1
            return
        elif offset > position[1] + 1:
            tally.holes += 1
            tally.lost += offset - position[1] - 1
        position[0], position[1] = epoch, offset

    def _recovered(self, data: bytes, now: int) -> None:
        assert self.book is not None
        tally = self.tally
        payload = json.loads(data)["payload"]
        stream, epoch, top = str(payload["stream"]), str(payload["epoch"]), int(payload["offset"])
        position = self.book.positions.get(stream)
        if payload.get("recovered") is True:
            tally.recovered += 1
            if position is None or position[0] != epoch or position[1] < top:
                tally.recovered_short += 1
        else:
            tally.not_recovered += 1
            # The browser refetches here; a top of 0 means the server does not
            # know it either, so the next event, whatever it is, starts afresh.
            self.book.positions[stream] = [epoch, top if top > 0 else -1]
        book = self.book
        book.got += 1
        if book.got == book.expect:
            tally.recovery_done += 1
            tally.recovered_ns.append(now)
            if book.recovered_ns == 0:
                tally.clients_recovered += 1
            book.recovered_ns = now
