"""A minimal HTTP/1.1 client on asyncio streams, with keep-alive.

The publisher posts thousands of events a second from the generator; a full
client library would spend more CPU per request than the server under test
spends routing one. This one writes a request and reads ``Content-Length``
bytes back, nothing more, and serves health checks and metrics too.
"""

from __future__ import annotations

import asyncio
import contextlib


class HttpError(Exception):
    """The peer closed the connection or answered something unreadable."""


class HttpConnection:
    """One keep-alive connection to ``host:port``."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self.host = host
        self.port = port
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self._prefix = f"Host: {host}:{port}\r\n{extra}"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """Send one request and return ``(status, body)``; reconnects once if needed."""
        head = (
            f"{method} {path} HTTP/1.1\r\n{self._prefix}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        for attempt in (0, 1):
            reader, writer = await self._connect()
            try:
                writer.write(head + body)
                return await self._response(reader)
            except (OSError, HttpError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise HttpError("unreachable")

    async def _response(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise HttpError("response head too long") from exc
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise HttpError(f"bad status line {lines[0]!r}")
        status = int(parts[1])
        length = 0
        close = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key == b"content-length":
                length = int(value.strip())
            elif key == b"connection" and value.strip().lower() == b"close":
                close = True
            elif key == b"transfer-encoding" and b"chunked" in value.lower():
                raise HttpError("chunked responses are not supported")
        body = await reader.readexactly(length) if length else b""
        if close:
            self.close()
        return status, body

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        self._reader = None
        self._writer = None


async def get(host: str, port: int, path: str, limit: float = 5.0) -> tuple[int, bytes]:
    """One GET on a fresh connection."""
    connection = HttpConnection(host, port, {"Connection": "close"})
    try:
        async with asyncio.timeout(limit):
            return await connection.request("GET", path)
    finally:
        connection.close()
