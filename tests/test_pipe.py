"""One pipelined Redis connection, its replies parsed where they arrive, on a
real ``redis-server`` (and :class:`~loadtest.harness.faults.TcpFaultProxy` for
faults)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.asyncio.connection import Connection, SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from loadtest.harness.faults import TcpFaultProxy
from server.redis.coalesce import ScriptCoalescer
from server.redis.pipe import Pipe, _packer_for
from tests.services import HOST, RedisServer, free_port
from tests.waiting import eventually

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
LOOPS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}
HANG_GUARD_S = 60.0
"""Against a hang only: a close is seen in milliseconds, a stall after an hour."""


def test_redis_pys_connection_still_has_the_streams_the_pipe_takes_over(
    fresh_redis: RedisServer,
) -> None:
    async def check() -> None:
        connection = Connection(port=fresh_redis.port)
        await connection.connect()  # type: ignore[no-untyped-call]
        try:
            reader, writer = connection._reader, connection._writer
            assert isinstance(reader, asyncio.StreamReader)
            assert isinstance(reader._buffer, bytearray)  # type: ignore[attr-defined]
            assert isinstance(writer, asyncio.StreamWriter)
            assert callable(writer.transport.set_protocol)
        finally:
            await connection.disconnect()

    asyncio.run(check())


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_replies_come_back_in_order_with_redis_pys_errors(
    fresh_redis: RedisServer, loop: str
) -> None:
    async def check() -> None:
        pipe = Pipe(Connection(port=fresh_redis.port), "test")
        try:
            futures = pipe.submit(
                ("SET", "pipe:k", "v"),
                ("GET", "pipe:k"),
                ("EVALSHA", "0" * 40, 0),
                ("INCR", "pipe:k"),
                ("RPUSH", "pipe:list", *range(1000)),
            )
            later = pipe.submit(("LRANGE", "pipe:list", 998, -1))
            outcomes = await asyncio.gather(*futures, *later, return_exceptions=True)
        finally:
            await pipe.close()
        assert outcomes[:2] == [b"OK", b"v"]
        assert isinstance(outcomes[2], NoScriptError)
        assert type(outcomes[3]) is ResponseError
        assert outcomes[4:] == [1000, [b"998", b"999"]]

    LOOPS[loop](check())


def test_replies_are_decoded_when_the_connection_decodes(fresh_redis: RedisServer) -> None:
    async def check() -> list[Any]:
        pipe = Pipe(Connection(port=fresh_redis.port, decode_responses=True), "test")
        try:
            return list(
                await asyncio.gather(*pipe.submit(("SET", "pipe:d", "é"), ("GET", "pipe:d")))
            )
        finally:
            await pipe.close()

    assert asyncio.run(check()) == ["OK", "é"]


COMMANDS: list[tuple[Any, ...]] = [
    ("SET", "pipe:k", "v"),
    ("EVALSHA", "f" * 40, 3, "ap:{g}:meta", "ap:{g}:hist", "ap:{g}:id:x", b"\x00e\x001\x00"),
    ("RPUSH", "pipe:é", -5, 0, 10**30, 0.1, 1e20, 2.0, b"", ""),
    ("PING",),
]


@pytest.mark.parametrize("encoding", ["utf-8", "UTF8", "latin-1"])
def test_commands_are_packed_as_redis_py_packs_them(encoding: str) -> None:
    connection = Connection(encoding=encoding)
    pack = _packer_for(connection)
    for command in COMMANDS:
        assert pack(command) == b"".join(connection.pack_command(*command))


@pytest.mark.parametrize("bad", [True, None, "\udc80", [1]])
async def test_an_argument_redis_cannot_take_is_refused_and_nothing_is_queued(
    fresh_redis: RedisServer, bad: Any
) -> None:
    pipe = Pipe(Connection(port=fresh_redis.port), "test")
    try:
        with pytest.raises(DataError):
            pipe.submit(("SET", "pipe:ok", "1"), ("SET", "pipe:bad", bad))
        # Neither command went out: the next reply is the next command's own.
        assert await pipe.submit(("EXISTS", "pipe:ok", "pipe:bad"))[0] == 0
    finally:
        await pipe.close()


async def connected(proxy: TcpFaultProxy, stall_timeout: float = 5.0) -> Pipe:
    pipe = Pipe(Connection(port=proxy.port), "test", stall_timeout)
    assert await pipe.submit(("PING",))[0] == b"PONG"  # the handshake is done
    return pipe


async def test_one_turns_commands_go_out_in_one_write(redis_proxy: TcpFaultProxy) -> None:
    pipe = await connected(redis_proxy)
    try:
        requests = redis_proxy.record_round_trips()
        futures = [*pipe.submit(("SET", "pipe:a", "1")), *pipe.submit(("INCR", "pipe:a"))]
        futures += pipe.submit(("GET", "pipe:a"))
        assert await asyncio.gather(*futures) == [b"OK", 2, b"2"]
        assert len(requests) == 1
        assert b"SET" in requests[0] and b"INCR" in requests[0] and b"GET" in requests[0]
    finally:
        await pipe.close()


async def test_a_lost_connection_fails_every_command_outstanding(
    redis_proxy: TcpFaultProxy,
) -> None:
    pipe = await connected(redis_proxy)
    try:
        redis_proxy.hold_replies()
        futures = pipe.submit(("INCR", "pipe:n"), ("INCR", "pipe:n"))
        await asyncio.sleep(0)  # written
        assert redis_proxy.cut() == 1
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes)
        assert pipe.dead
        (after,) = pipe.submit(("PING",))
        assert after.done() and isinstance(after.exception(), RedisConnectionError)
    finally:
        await pipe.close()


async def test_a_connection_that_stops_answering_is_given_up_on(
    redis_proxy: TcpFaultProxy,
) -> None:
    pipe = await connected(redis_proxy, stall_timeout=0.3)
    try:
        redis_proxy.hold_replies()
        (reply,) = pipe.submit(("PING",))
        with pytest.raises(RedisTimeoutError):
            await reply
        assert pipe.dead
    finally:
        await pipe.close()


async def test_a_connection_closed_after_its_handshake_fails_at_once() -> None:
    """A server that answers the handshake (under RESP2, redis-py's two ``CLIENT
    SETINFO``), then closes: the command fails on the close, not after the stall
    timeout."""

    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = b""
        while seen.count(b"SETINFO") < 2:
            chunk = await reader.read(4096)
            if not chunk:
                return
            seen += chunk
        writer.write(b"+OK\r\n+OK\r\n")
        writer.close()

    server = await asyncio.start_server(answer_then_close, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # The close read by the pipe's protocol, and read by redis-py's before the
        # pipe took the connection (a connection already made is taken as it is).
        for closed_before in (False, True):
            connection = Connection(port=port, protocol=2)
            if closed_before:
                await connection.connect()  # type: ignore[no-untyped-call]
                reader = connection._reader
                assert reader is not None
                await eventually(reader.at_eof, HANG_GUARD_S, "redis-py's stream to see the EOF")
            pipe = Pipe(connection, "test", stall_timeout=3600)
            try:
                (reply,) = pipe.submit(("PING",))
                with pytest.raises(RedisConnectionError):
                    await asyncio.wait_for(reply, HANG_GUARD_S)
                assert pipe.dead
            finally:
                await pipe.close()
    finally:
        server.close()


async def test_a_handshake_never_answered_is_given_up_on(redis_proxy: TcpFaultProxy) -> None:
    redis_proxy.blackhole()  # the TCP connection is taken, nothing passes
    pipe = Pipe(Connection(port=redis_proxy.port), "test", stall_timeout=0.3)
    try:
        (reply,) = pipe.submit(("PING",))
        with pytest.raises(RedisTimeoutError):
            await reply
        assert pipe.dead
    finally:
        redis_proxy.heal()
        await pipe.close()


@pytest.fixture(scope="module")
def tls_redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A ``redis-server`` that speaks TLS only, with a throwaway self-signed certificate."""
    directory = tmp_path_factory.mktemp("tls-redis")
    cert, key = directory / "cert.pem", directory / "key.pem"
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    subject = ["-subj", f"/CN={HOST}", "-keyout", str(key), "-out", str(cert)]
    subprocess.run([*openssl, *subject], check=True, capture_output=True)
    port = free_port()
    plain_off = ["--save", "", "--appendonly", "no", "--bind", HOST, "--port", "0"]
    tls = ["--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    clients = ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    process = subprocess.Popen(
        ["redis-server", *plain_off, *tls, *clients],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_tls(port, cert, process)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def _wait_for_tls(port: int, cert: Path, process: subprocess.Popen[bytes]) -> None:
    context = ssl.create_default_context(cafile=str(cert))
    context.check_hostname = False
    deadline = time.monotonic() + 30
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), 1) as raw, context.wrap_socket(raw):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server with TLS on {port} did not come up ({process.poll()})")


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_tls_connection_is_taken_over_too(tls_redis_port: int, loop: str) -> None:
    async def check() -> list[Any]:
        connection = SSLConnection(host=HOST, port=tls_redis_port, ssl_cert_reqs="none")
        pipe = Pipe(connection, "tls")
        try:
            futures = pipe.submit(
                ("SET", "pipe:tls", "v"), ("GET", "pipe:tls"), ("EVALSHA", "0" * 40, 0)
            )
            return list(await asyncio.gather(*futures, return_exceptions=True))
        finally:
            await pipe.close()

    set_reply, get_reply, evalsha = LOOPS[loop](check())
    assert (set_reply, get_reply) == (b"OK", b"v")
    assert isinstance(evalsha, NoScriptError)


async def test_a_coalescer_on_a_rediss_url(tls_redis_port: int) -> None:
    client = aioredis.Redis.from_url(f"rediss://{HOST}:{tls_redis_port}/0?ssl_cert_reqs=none")
    coalescer = ScriptCoalescer(client, "return redis.call('INCRBY', KEYS[1], ARGV[1])")
    try:
        results = await asyncio.gather(*(coalescer.run([(["pipe:tls:n"], [i])]) for i in (1, 2, 3)))
        assert results == [[1], [3], [6]]
    finally:
        await coalescer.close()
        await client.aclose()
