"""HTTP/1.1 requests in, responses out, without I/O (RFC 9110 and 9112).

The node's internal listener takes one ``POST /publish`` per game event from
the backend, so its cost per request is part of every event's fan-out. This
parser does what that listener needs and no more: request line, header
fields, a body framed by ``Content-Length`` or chunked, keep-alive and
pipelining. Whatever it cannot take is refused with the status the RFCs name
(400, 413, 417, 431, 501, 505), after which the connection must be closed: the
framing of anything behind a refused request is unknown.

Feed it bytes as they arrive (:meth:`RequestParser.feed`), take whole requests
(:meth:`RequestParser.next_request`), and write what :func:`response` builds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus

MAX_HEAD_BYTES = 16 * 1024
"""Request line plus header fields: a backend's publish sends a few hundred bytes."""
MAX_HEADER_FIELDS = 100


class HttpError(Exception):
    """A request that cannot be taken: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class Request:
    method: str
    target: str
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    headers: dict[str, str]  # lower-case names; repeated fields joined with ", "
    body: bytes
    keep_alive: bool

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]


# What ``bytes.translate(None, ...)`` deletes: a value made only of these is empty after.
_TOKEN = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_HEX = b"0123456789abcdefABCDEF"
_VISIBLE = bytes(range(0x21, 0x7F))  # a request target's characters (RFC 3986)


def _is_token(value: bytes) -> bool:
    return bool(value) and not value.translate(None, _TOKEN)


class RequestParser:
    """One connection's incoming bytes, cut into requests."""

    def __init__(self, max_body: int, max_head: int = MAX_HEAD_BYTES) -> None:
        self.max_body = max_body
        self.max_head = max_head
        self._buffer = bytearray()
        self._head: tuple[str, str, str, dict[str, str]] | None = None
        self._length = 0  # the body's length, when framed by Content-Length
        self._chunked = False
        self._chunks = bytearray()  # a chunked body decoded so far
        self._continue_owed = False

    @property
    def buffered(self) -> int:
        """Bytes received and not yet taken as a request."""
        return len(self._buffer)

    @property
    def midway(self) -> bool:
        """Part of a request has arrived, not all of it."""
        return bool(self._buffer) or self._head is not None

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def take_continue(self) -> bool:
        """True once per request that sent ``Expect: 100-continue`` and whose body
        has not all arrived: the client waits for ``100 Continue`` before sending it."""
        owed, self._continue_owed = self._continue_owed, False
        return owed

    def next_request(self) -> Request | None:
        """The next whole request, or None until more bytes arrive. Raises
        :class:`HttpError` for a request that cannot be taken."""
        if self._head is None and not self._parse_head():
            return None
        assert self._head is not None
        body = self._read_chunked() if self._chunked else self._read_sized()
        if body is None:
            return None
        method, target, version, headers = self._head
        self._head = None
        self._continue_owed = False
        return Request(method, target, version, headers, body, _keep_alive(version, headers))

    def _parse_head(self) -> bool:
        buffer = self._buffer
        # Blank lines before a request line are ignored (RFC 9112 section 2.2).
        while buffer[:2] == b"\r\n":
            del buffer[:2]
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > self.max_head:
                raise HttpError(431, f"request head over {self.max_head} bytes")
            return False
        if end > self.max_head:
            raise HttpError(431, f"request head over {self.max_head} bytes")
        lines = bytes(buffer[:end]).split(b"\r\n")
        del buffer[: end + 4]
        method, target, version = _request_line(lines[0])
        if len(lines) - 1 > MAX_HEADER_FIELDS:
            raise HttpError(431, f"over {MAX_HEADER_FIELDS} header fields")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not _is_token(name):
                raise HttpError(400, "malformed header field")  # also obs-fold and " :"
            key = name.decode("ascii").lower()
            text = value.strip(b" \t").decode("latin-1")
            if key in headers:
                if key in ("content-length", "host"):
                    raise HttpError(400, f"repeated {key}")
                headers[key] = f"{headers[key]}, {text}"
            else:
                headers[key] = text
        self._frame_body(version, headers)
        self._head = (method, target, version, headers)
        return True

    def _frame_body(self, version: str, headers: dict[str, str]) -> None:
        coding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        self._chunked = False
        self._length = 0
        if coding is not None:
            if length is not None:
                # Both: a classic request-smuggling shape (RFC 9112 section 6.3).
                raise HttpError(400, "both Transfer-Encoding and Content-Length")
            if version != "HTTP/1.1" or coding.lower() != "chunked":
                raise HttpError(501, f"transfer coding not supported: {coding}")
            self._chunked = True
            self._chunks = bytearray()
        elif length is not None:
            if not length.isdigit() or not length.isascii():
                raise HttpError(400, "invalid Content-Length")
            self._length = int(length)
            if self._length > self.max_body:
                raise HttpError(413, f"body over {self.max_body} bytes")
        expect = headers.get("expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                raise HttpError(417, f"expectation not supported: {expect}")
            self._continue_owed = version == "HTTP/1.1"

    def _read_sized(self) -> bytes | None:
        length = self._length
        buffer = self._buffer
        if len(buffer) < length:
            return None
        body = bytes(buffer[:length])
        del buffer[:length]
        return body

    def _read_chunked(self) -> bytes | None:
        buffer = self._buffer
        while True:
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > self.max_head:
                    raise HttpError(400, "chunk size line too long")
                return None
            size_field = bytes(buffer[:end]).partition(b";")[0].strip(b" \t")
            if not size_field or size_field.translate(None, _HEX):
                raise HttpError(400, "invalid chunk size")
            size = int(size_field, 16)
            if size == 0:
                # The last chunk, then trailer fields (ignored) up to an empty line.
                trailer_end = buffer.find(b"\r\n\r\n", end)  # at ``end``: no trailers
                if trailer_end < 0:
                    if len(buffer) > self.max_head:
                        raise HttpError(431, "chunked trailer too long")
                    return None
                del buffer[: trailer_end + 4]
                body, self._chunks = bytes(self._chunks), bytearray()
                return body
            if len(self._chunks) + size > self.max_body:
                raise HttpError(413, f"body over {self.max_body} bytes")
            start = end + 2
            if len(buffer) < start + size + 2:
                return None
            if buffer[start + size : start + size + 2] != b"\r\n":
                raise HttpError(400, "chunk not followed by CRLF")
            self._chunks += buffer[start : start + size]
            del buffer[: start + size + 2]


def _request_line(line: bytes) -> tuple[str, str, str]:
    parts = line.split(b" ")
    if len(parts) != 3 or not _is_token(parts[0]) or not parts[1]:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        if version.startswith(b"HTTP/"):
            raise HttpError(505, "only HTTP/1.0 and HTTP/1.1")
        raise HttpError(400, "malformed request line")
    if target.translate(None, _VISIBLE):
        raise HttpError(400, "malformed request target")
    return method.decode("ascii"), target.decode("ascii"), version.decode("ascii")


def _keep_alive(version: str, headers: dict[str, str]) -> bool:
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    if version == "HTTP/1.1":
        return "close" not in tokens
    return "keep-alive" in tokens


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_date_second = -1
_date_text = ""


def _date() -> str:
    """The Date field (RFC 9110 section 6.6.1), formatted once a second."""
    global _date_second, _date_text
    now = int(time.time())
    if now != _date_second:
        _date_second, _date_text = now, formatdate(now, usegmt=True)
    return _date_text


_REASONS = {status.value: status.phrase for status in HTTPStatus}


def response(
    status: int,
    body: bytes,
    content_type: str,
    *,
    keep_alive: bool,
    head_only: bool = False,
    headers: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A whole response: status line, fields and (unless ``head_only``) the body."""
    fields = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        f"Date: {_date()}",
    ]
    if not keep_alive:
        fields.append("Connection: close")
    fields.extend(f"{name}: {value}" for name, value in headers)
    head = ("\r\n".join(fields) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body
