"""Fault proxies on 127.0.0.1: one for Redis (TCP), one for DynamoDB (HTTP).

Both run in the caller's event loop (``await proxy.start()`` /
``await proxy.stop()``) and listen on a free port of 127.0.0.1 only; a server
under test is pointed at the proxy instead of the real service.

:class:`TcpFaultProxy` forwards bytes both ways and, on demand:

- ``latency``: every chunk is held that long before it goes on (each
  direction; a timestamped queue, so throughput is not capped by the delay);
- ``blackhole()``: nothing moves any more, and nothing is closed either (no
  RST, no FIN), as when a network path drops every packet; new connections
  are accepted and then hear nothing. ``heal()`` lets the held bytes through,
  as TCP's retransmissions would, to the connections that are still open;
- ``cut()``: every open connection is reset (RST) at once;
- ``cut_after(pattern)``: the next client chunk holding ``pattern`` is
  forwarded, and then its client connection is reset before any reply comes
  back: the command ran, its caller never heard so (the case that makes a
  client library resend a pipeline);
- ``cut_before(pattern)``: the next client chunk holding ``pattern`` is
  dropped and its connection reset: the command never ran, and its caller
  knows it failed, while the proxy's other connections carry on.

:class:`DynamoFaultProxy` speaks the AWS JSON protocol generically (DynamoDB,
SQS, DynamoDB Streams) and injects errors, throttling, latency and lost
responses, either armed one by one by a test or at random from a seed for
the chaos scenario (``loadtest/scenarios/chaos.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from loadtest.harness.servers import HOST, free_port

CHUNK = 65536


class _Link:
    """One proxied connection: client <-> upstream, two pumps."""

    def __init__(
        self,
        proxy: TcpFaultProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client_reader, self.client_writer = client
        self.upstream_writer: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self.awaiting_reply = False  # a request went up and no reply came down yet

    async def run(self) -> None:
        proxy = self.proxy
        await proxy._passable.wait()  # a blackhole holds new connections too
        try:
            upstream_reader, self.upstream_writer = await asyncio.open_connection(
                proxy.upstream_host, proxy.upstream_port
            )
        except OSError:
            self.reset()
            return
        up = asyncio.create_task(self._pump(self.client_reader, self.upstream_writer, True))
        down = asyncio.create_task(self._pump(upstream_reader, self.client_writer, False))
        self.tasks = [up, down]
        await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        self.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool
    ) -> None:
        proxy = self.proxy
        queue: deque[tuple[float, bytes]] = deque()
        ready = asyncio.Event()
        eof = False

        async def feed() -> None:
            nonlocal eof
            while True:
                try:
                    data = await reader.read(CHUNK)
                except (ConnectionError, OSError):
                    data = b""
                if not data:
                    eof = True
                    ready.set()
                    return
                queue.append((time.monotonic() + proxy.latency, data))
                ready.set()

        feeder = asyncio.create_task(feed())
        try:
            while True:
                if not queue:
                    if eof:
                        return
                    ready.clear()
                    await ready.wait()
                    continue
                due, data = queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await proxy._passable.wait()
                if not upstream:
                    await proxy._replies_passable.wait()
                queue.popleft()
                if not upstream and self.closed:
                    return
                if upstream and proxy._take(proxy._drop_patterns, data):
                    proxy.cuts_before_write += 1
                    self.reset()
                    return
                if proxy.requests is not None:
                    if not upstream:
                        self.awaiting_reply = False
                    elif self.awaiting_reply:
                        proxy.requests[-1] += data  # more of the same round trip
                    else:
                        self.awaiting_reply = True
                        proxy.requests.append(bytearray(data))
                writer.write(data)
                await writer.drain()
                if upstream and proxy._take(proxy._cut_patterns, data):
                    # The command reached the server; its caller never hears back.
                    proxy.cuts_after_write += 1
                    self.reset_client()
        except (ConnectionError, OSError):
            return
        finally:
            feeder.cancel()

    def reset_client(self) -> None:
        """RST to the client; the upstream side drains the reply into nothing."""
        _abort(self.client_writer)
        self.closed = True

    def reset(self) -> None:
        self.closed = True
        _abort(self.client_writer)
        if self.upstream_writer is not None:
            _abort(self.upstream_writer)
        for task in self.tasks:
            task.cancel()

    def close(self) -> None:
        self.closed = True
        for task in self.tasks:
            task.cancel()
        self.client_writer.close()
        if self.upstream_writer is not None:
            self.upstream_writer.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            # Linger 0: close() sends RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpFaultProxy:
    """A TCP proxy to ``upstream_host:upstream_port`` with faults on demand."""

    def __init__(self, upstream_port: int, upstream_host: str = HOST, port: int = 0) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = port
        self.latency = 0.0
        self.cuts_after_write = 0
        self.cuts_before_write = 0
        self._cut_patterns: list[bytes] = []
        self._drop_patterns: list[bytes] = []
        self._passable = asyncio.Event()
        self._passable.set()
        self._replies_passable = asyncio.Event()
        self._replies_passable.set()
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None
        self.requests: list[bytearray] | None = None
        """While recording: the bytes of each round trip a client started (a request,
        or a pipeline, sent on a connection with no reply outstanding)."""

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def record_round_trips(self) -> list[bytearray]:
        """Start recording round trips (from now on, on every connection)."""
        self.requests = []
        for link in self._links:
            link.awaiting_reply = False
        return self.requests

    async def start(self) -> None:
        if not self.port:
            self.port = free_port()
        self._server = await asyncio.start_server(self._accept, HOST, self.port)

    async def stop(self) -> None:
        self._passable.set()
        self._replies_passable.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self._links):
            link.reset()
        self._links.clear()

    @property
    def blackholed(self) -> bool:
        return not self._passable.is_set()

    def blackhole(self) -> None:
        self._passable.clear()

    def hold_replies(self) -> None:
        """Commands still reach the server; its replies wait until :meth:`heal`."""
        self._replies_passable.clear()

    def heal(self) -> None:
        """End a blackhole, held replies, the latency and the cuts not yet made."""
        self.latency = 0.0
        self._cut_patterns.clear()
        self._drop_patterns.clear()
        self._passable.set()
        self._replies_passable.set()

    def cut(self) -> int:
        """Reset every open connection; how many."""
        links = list(self._links)
        for link in links:
            link.reset()
        return len(links)

    def cut_after(self, pattern: bytes, count: int = 1) -> None:
        """The next ``count`` client chunks holding ``pattern`` reach the server,
        and each one's connection is then reset before its reply."""
        self._cut_patterns.extend([pattern] * count)

    def cut_before(self, pattern: bytes, count: int = 1) -> None:
        """The next ``count`` client chunks holding ``pattern`` never reach the
        server: each one's connection is reset instead."""
        self._drop_patterns.extend([pattern] * count)

    @staticmethod
    def _take(patterns: list[bytes], data: bytes) -> bool:
        for index, pattern in enumerate(patterns):
            if pattern in data:
                del patterns[index]
                return True
        return False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(self, (reader, writer))
        self._links.add(link)
        try:
            await link.run()
        finally:
            self._links.discard(link)


# ------------------------------------------------------------ DynamoDB fault proxy


def aws_error(code: str, status: int, message: str) -> Any:
    from aiohttp import web

    payload = {"__type": f"com.amazonaws.dynamodb.v20120810#{code}", "message": message}
    return web.Response(
        status=status, body=json.dumps(payload).encode(), content_type="application/x-amz-json-1.0"
    )


class DynamoFaultProxy:
    """An HTTP proxy in front of a DynamoDB endpoint that injects faults.

    It speaks the AWS JSON protocol generically, so it also stands in front of
    moto's SQS (``AmazonSQS.*`` targets) and DynamoDB Streams.

    moto never throttles and never leaves BatchWriteItem items unprocessed, so
    tests point a store at this proxy instead and arm it:

    - ``fail_next(n, code, status)``: the next ``n`` requests get that error
      (for example ``ThrottlingException`` with 400, ``InternalServerError``
      with 500) without reaching the upstream.
    - ``unprocessed_rounds = n``: the next ``n`` BatchWriteItem calls forward only
      the first half of their items and return the rest as ``UnprocessedItems``.
    - ``fail_statements(codes)``: in the next BatchExecuteStatement, statement
      ``i`` with a code in ``codes[i]`` is not forwarded and is answered with that
      error (``ThrottlingError``, ``ConditionalCheckFailed``...), as DynamoDB
      answers each statement on its own; moto never does.
    - ``drop_response(operation, n)``: the next ``n`` requests of ``operation``
      reach the upstream and are applied there, and their caller gets no
      answer (the connection is closed): a read timeout after the write.
    - ``randomize(rng, ...)``: from now on each request fails, is throttled or
      is delayed by chance (the chaos scenario), until ``recover()``.

    ``operations`` records the DynamoDB operation name of every request seen,
    ``batch_sizes`` the number of items of every BatchWriteItem and
    ``user_agents`` every ``User-Agent`` header. Like DynamoDB
    (and unlike moto), it refuses a BatchWriteItem of more than 25 items and a
    BatchExecuteStatement of more than 25 statements.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.operations: list[str] = []
        self.batch_sizes: list[int] = []
        self.user_agents: set[str] = set()
        self.unprocessed_rounds = 0
        self._statement_failures: list[list[str | None]] = []
        self.injected: dict[str, int] = {}
        self._failures: list[tuple[str, int]] = []
        self._operation_failures: dict[str, list[tuple[str, int]]] = {}
        self._dropped: dict[str, int] = {}
        self._outage: tuple[str, int] | None = None
        self._random: tuple[random.Random, float, float, float] | None = None
        self._runner: Any = None
        self._session: Any = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def fail_next(self, count: int, code: str = "ThrottlingException", status: int = 400) -> None:
        self._failures.extend([(code, status)] * count)

    def fail_operation(
        self, operation: str, count: int, code: str = "InternalServerError", status: int = 500
    ) -> None:
        """The next ``count`` requests of one operation (``DeleteMessageBatch``) fail."""
        self._operation_failures.setdefault(operation, []).extend([(code, status)] * count)

    def fail_statements(self, codes: Sequence[str | None]) -> None:
        """The next BatchExecuteStatement: statement ``i`` fails with ``codes[i]``
        (None, or past the end: forwarded) without reaching the upstream."""
        self._statement_failures.append(list(codes))

    def drop_response(self, operation: str, count: int = 1) -> None:
        self._dropped[operation] = self._dropped.get(operation, 0) + count

    def fail_all(self, code: str = "InternalServerError", status: int = 500) -> None:
        """An outage: every request fails until ``recover()``; the upstream keeps its data."""
        self._outage = (code, status)

    def randomize(
        self, rng: random.Random, *, errors: float, throttles: float, latency: float = 0.0
    ) -> None:
        """Each request: an error (500) with chance ``errors``, a throttle with
        chance ``throttles``, and up to ``latency`` seconds of delay."""
        self._random = (rng, errors, throttles, latency)

    def recover(self) -> None:
        self._outage = None
        self._random = None
        self._failures.clear()
        self._operation_failures.clear()
        self._statement_failures.clear()
        self._dropped.clear()

    def count(self, operation: str) -> int:
        return self.operations.count(operation)

    async def start(self) -> None:
        from aiohttp import ClientSession, web

        self._session = ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.port = free_port()
        site = web.TCPSite(self._runner, HOST, self.port)
        await site.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _inject(self, operation: str) -> tuple[str, int] | None:
        if self._outage is not None:
            return self._outage
        if self._failures:
            return self._failures.pop(0)
        if self._operation_failures.get(operation):
            return self._operation_failures[operation].pop(0)
        return None

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        target = request.headers.get("X-Amz-Target", "")
        operation = target.rpartition(".")[2]
        self.operations.append(operation)
        self.user_agents.add(request.headers.get("User-Agent", ""))
        body = await request.read()
        injected = self._inject(operation)
        if injected is None and self._random is not None:
            rng, errors, throttles, latency = self._random
            if latency:
                await asyncio.sleep(rng.uniform(0, latency))
            roll = rng.random()
            if roll < errors:
                injected = ("InternalServerError", 500)
            elif roll < errors + throttles:
                injected = ("ThrottlingException", 400)
        if injected is not None:
            code, status = injected
            self.injected[code] = self.injected.get(code, 0) + 1
            return aws_error(code, status, f"injected {code}")
        if operation == "BatchWriteItem":
            size = sum(len(r) for r in json.loads(body).get("RequestItems", {}).values())
            self.batch_sizes.append(size)
            if size > 25:
                return aws_error(
                    "ValidationException",
                    400,
                    "Too many items requested for the BatchWriteItem call",
                )
        if operation == "BatchExecuteStatement":
            document = json.loads(body)
            if len(document.get("Statements", [])) > 25:
                return aws_error(
                    "ValidationException", 400, "Member must have length less than or equal to 25"
                )
            if self._statement_failures:
                codes = self._statement_failures.pop(0)
                return await self._answer_statements(request, document, codes)
        held_back: dict[str, list[Any]] = {}
        if operation == "BatchWriteItem" and self.unprocessed_rounds > 0:
            self.unprocessed_rounds -= 1
            document = json.loads(body)
            forwarded: dict[str, list[Any]] = {}
            for table, requests in document["RequestItems"].items():
                half = max(1, len(requests) // 2)
                forwarded[table] = requests[:half]
                if requests[half:]:
                    held_back[table] = requests[half:]
            document["RequestItems"] = forwarded
            body = json.dumps(document).encode()
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=_forwarded_headers(request),
            data=body,
        ) as upstream:
            status = upstream.status
            content = await upstream.read()
            content_type = upstream.headers.get("Content-Type", "application/x-amz-json-1.0")
        if self._dropped.get(operation):
            # Applied upstream; the caller's connection dies before the answer.
            self._dropped[operation] -= 1
            self.injected["dropped"] = self.injected.get("dropped", 0) + 1
            request.transport.abort()
            raise asyncio.CancelledError
        if held_back and status == 200:
            document = json.loads(content)
            document["UnprocessedItems"] = held_back
            content = json.dumps(document).encode()
        # botocore checks x-amz-crc32 when present, so it is not copied from upstream.
        return web.Response(status=status, body=content, headers={"Content-Type": content_type})

    async def _answer_statements(
        self, request: Any, document: dict[str, Any], codes: Sequence[str | None]
    ) -> Any:
        """Forward the statements that do not fail, then answer every statement in
        its place: the upstream's answer, or the injected error."""
        from aiohttp import web

        statements = document["Statements"]
        failing = {i: code for i, code in enumerate(codes[: len(statements)]) if code is not None}
        answers: list[Any] = [None] * len(statements)
        for index, code in failing.items():
            self.injected[code] = self.injected.get(code, 0) + 1
            answers[index] = {"Error": {"Code": code, "Message": f"injected {code}"}}
        forwarded = [i for i in range(len(statements)) if i not in failing]
        if forwarded:
            document["Statements"] = [statements[i] for i in forwarded]
            async with self._session.request(
                request.method,
                self.upstream + request.path_qs,
                headers=_forwarded_headers(request),
                data=json.dumps(document).encode(),
            ) as upstream:
                content = await upstream.read()
                if upstream.status != 200:
                    return web.Response(status=upstream.status, body=content)
            for index, answer in zip(forwarded, json.loads(content)["Responses"], strict=True):
                answers[index] = answer
        return web.Response(
            body=json.dumps({"Responses": answers}).encode(),
            headers={"Content-Type": "application/x-amz-json-1.0"},
        )


def _forwarded_headers(request: Any) -> dict[str, str]:
    """A request's headers for the upstream: the body and the host are the proxy's."""
    return {
        name: value
        for name, value in request.headers.items()
        if name.lower() not in ("host", "content-length", "transfer-encoding")
    }


__all__ = ["DynamoFaultProxy", "TcpFaultProxy", "aws_error"]
