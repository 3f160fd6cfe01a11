"""The internal listener's HTTP/1.1 parsing, without I/O (``protocol/http11.py``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.http11 import CONTINUE, HttpError, Request, RequestParser, response

LIMIT = 1024


def parse_all(data: bytes, pieces: list[int] | None = None) -> list[Request]:
    """Every request in ``data``, fed whole or cut at ``pieces``."""
    parser = RequestParser(LIMIT)
    cuts = sorted({0, *(p % (len(data) + 1) for p in pieces or []), len(data)})
    out: list[Request] = []
    for start, end in itertools.pairwise(cuts):
        parser.feed(data[start:end])
        while (request := parser.next_request()) is not None:
            out.append(request)
    assert not parser.midway
    return out


def refused(data: bytes) -> HttpError:
    parser = RequestParser(LIMIT)
    parser.feed(data)
    with pytest.raises(HttpError) as caught:
        while parser.next_request() is not None:
            pass
    return caught.value


POST = (
    b"POST /publish?x=1 HTTP/1.1\r\nHost: n\r\nAuthorization: Bearer s\r\n"
    b'Content-Length: 11\r\n\r\n{"a":"b c"}'
)
CHUNKED = (
    b"POST /publish HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'4;ext=1\r\n{"a"\r\n6\r\n:"b c"\r\n1\r\n}\r\n0\r\nTrailer-Field: x\r\n\r\n'
)
GET_CLOSE = b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"


def test_a_post_with_a_sized_body() -> None:
    (request,) = parse_all(POST)
    assert (request.method, request.target, request.path, request.version) == (
        "POST",
        "/publish?x=1",
        "/publish",
        "HTTP/1.1",
    )
    assert request.headers == {"host": "n", "authorization": "Bearer s", "content-length": "11"}
    assert request.body == b'{"a":"b c"}'
    assert request.keep_alive


def test_a_chunked_body_is_joined_and_its_extensions_and_trailers_dropped() -> None:
    (request,) = parse_all(CHUNKED)
    assert request.body == b'{"a":"b c"}'


def test_pipelined_requests_come_out_in_order() -> None:
    requests = parse_all(POST + CHUNKED + GET_CLOSE)
    assert [r.method for r in requests] == ["POST", "POST", "GET"]
    assert [r.keep_alive for r in requests] == [True, True, False]


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_cut_of_the_bytes_gives_the_same_requests(pieces: list[int]) -> None:
    whole = parse_all(POST + CHUNKED + GET_CLOSE)
    assert parse_all(POST + CHUNKED + GET_CLOSE, pieces) == whole


def test_keep_alive_by_version_and_connection_field() -> None:
    def keep(head: bytes) -> bool:
        (request,) = parse_all(head + b"\r\n\r\n")
        return request.keep_alive

    assert keep(b"GET / HTTP/1.1")
    assert not keep(b"GET / HTTP/1.1\r\nConnection: Keep-Alive, close")
    assert not keep(b"GET / HTTP/1.0")
    assert keep(b"GET / HTTP/1.0\r\nConnection: keep-alive")


def test_repeated_fields_are_joined_and_blank_lines_before_a_request_ignored() -> None:
    (request,) = parse_all(b"\r\n\r\nGET / HTTP/1.1\r\nAccept: a\r\naccept: b\r\n\r\n")
    assert request.headers == {"accept": "a, b"}


def test_expect_100_continue_is_owed_once_until_the_body_arrives() -> None:
    parser = RequestParser(LIMIT)
    parser.feed(b"POST /p HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert parser.next_request() is None
    assert parser.take_continue() and not parser.take_continue()
    parser.feed(b"ok")
    request = parser.next_request()
    assert request is not None and request.body == b"ok"
    assert CONTINUE == b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"POST / HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 1025\r\n\r\n", 413),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n401\r\n", 413),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET /\r\n\r\n", 400),
        (b"GET /a b HTTP/1.1\r\n\r\n", 400),
        (b"GET /\x7f HTTP/1.1\r\n\r\n", 400),
        (b"G(T / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost : n\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nA: 1\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nNoColon\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nExpect: 200-ok\r\n\r\n", 417),
        (b"GET / HTTP/1.1\r\n" + b"A: b\r\n" * 101 + b"\r\n", 431),
        (b"GET / HTTP/1.1\r\nA: " + b"b" * 20_000, 431),
    ],
)
def test_what_cannot_be_taken_is_refused_with_its_status(data: bytes, status: int) -> None:
    assert refused(data).status == status


def test_a_response_has_its_length_date_and_close() -> None:
    data = response(202, b'{"ok":1}', "application/json", keep_alive=False)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 202 Accepted"
    assert "Content-Length: 8" in lines and "Connection: close" in lines
    assert any(line.startswith("Date: ") and line.endswith(" GMT") for line in lines)
    assert body == b'{"ok":1}'
    kept = response(200, b"x", "text/plain", keep_alive=True, head_only=True)
    assert b"Connection" not in kept and kept.endswith(b"\r\n\r\n")
    assert b"Content-Length: 1" in kept  # HEAD: the length GET would have sent
