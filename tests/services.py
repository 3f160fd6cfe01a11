"""Start real backing services for tests: a moto DynamoDB server and a Redis server.

Plain functions, usable from pytest fixtures, scripts and the load tester alike.
Each service listens on a free port on 127.0.0.1 and runs as a child process
that ``stop()`` kills.

Environment overrides let CI bring its own services:

- ``AP_TEST_DYNAMODB_ENDPOINT``: used by :func:`dynamodb_endpoint_for_tests`
  instead of starting moto.
- ``AP_TEST_REDIS_URL``: used by :func:`redis_url_for_tests` instead of starting
  ``redis-server``. Under pytest-xdist each worker takes its own database number
  on it (the URL's, plus the worker's index), so fixed key names never meet;
  channels are not per database in Redis, so what uses it names its channels
  per test. Nodes, whose channel names are fixed, run on the worker's own
  ``redis-server`` instead (``fresh_redis`` in tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from loadtest.harness.servers import redis_ping

HOST = "127.0.0.1"
DYNAMODB_ENDPOINT_ENV = "AP_TEST_DYNAMODB_ENDPOINT"
REDIS_URL_ENV = "AP_TEST_REDIS_URL"

_FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class ServiceError(RuntimeError):
    """A test service did not start."""


def worker_index() -> int:
    """This pytest-xdist worker's number (``gw3`` is 3); 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


REDIS_DATABASES = 16
"""Redis's default ``databases``: how many workers can share one ``AP_TEST_REDIS_URL``."""


def per_worker_database(url: str) -> str:
    """``url`` with its database number moved up by this worker's index."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.strip("/")
    base = int(path) if path.isdigit() else 0
    database = base + worker_index()
    if database >= REDIS_DATABASES:
        raise ServiceError(
            f"{REDIS_URL_ENV}={url}: worker {worker_index()} would use database {database}, "
            f"past Redis's default {REDIS_DATABASES}; run fewer workers or start at /0"
        )
    return urllib.parse.urlunsplit(parts._replace(path=f"/{database}"))


def ensure_fake_aws_credentials() -> None:
    """Give botocore credentials for moto unless some are already set.

    Without them botocore walks its whole provider chain (including the EC2
    metadata endpoint, which takes seconds to time out) and then fails.
    """
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE"):
        return
    for name, value in _FAKE_AWS_ENV.items():
        os.environ.setdefault(name, value)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _stop_process(process: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)


def _read_log(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()[-2000:]
    except OSError:
        return ""


# --------------------------------------------------------------------------- moto


@dataclass
class MotoServer:
    """A ``moto_server`` child process."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: str

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stop(self) -> None:
        _stop_process(self.process)
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


def _moto_command(port: int) -> list[str]:
    script = shutil.which("moto_server")
    if script is not None:
        return [script, "-H", HOST, "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]


def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            response.read()
        return True
    except urllib.error.HTTPError:
        return True  # any HTTP status means the server is up
    except (OSError, urllib.error.URLError):
        return False


def start_moto_server(timeout: float = 30.0, port: int | None = None) -> MotoServer:
    """Launch ``moto_server`` on ``port`` (a free one by default) and wait until it answers."""
    ensure_fake_aws_credentials()
    port = free_port() if port is None else port
    log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(
        _moto_command(port),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    server = MotoServer(port=port, process=process, log_path=log.name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = _read_log(log.name)
            server.stop()
            raise ServiceError(f"moto_server exited with {process.returncode}: {output}")
        if _http_answers(f"{server.endpoint}/moto-api/"):
            return server
        time.sleep(0.05)
    output = _read_log(log.name)
    server.stop()
    raise ServiceError(f"moto_server did not answer on {server.endpoint} in {timeout}s: {output}")


@contextlib.contextmanager
def dynamodb_endpoint_for_tests() -> Iterator[str]:
    """An endpoint URL speaking DynamoDB: ``AP_TEST_DYNAMODB_ENDPOINT`` or a fresh moto."""
    ensure_fake_aws_credentials()
    override = os.environ.get(DYNAMODB_ENDPOINT_ENV)
    if override:
        yield override
        return
    server = start_moto_server()
    try:
        yield server.endpoint
    finally:
        server.stop()


# -------------------------------------------------------------------------- redis


@dataclass
class RedisServer:
    """A ``redis-server`` child process; ``restart()`` keeps the same port."""

    port: int
    binary: str = "redis-server"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_path: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        log = tempfile.NamedTemporaryFile(prefix="redis-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = log.name
        self.process = subprocess.Popen(
            [
                self.binary,
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                HOST,
                "--port",
                str(self.port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                output = _read_log(self.log_path)
                self.stop()
                raise ServiceError(f"redis-server exited with {code} on port {self.port}: {output}")
            if redis_ping(self.port):
                return
            time.sleep(0.02)
        self.stop()
        raise ServiceError(f"redis-server did not answer PING on port {self.port} in {timeout}s")

    def stop(self) -> None:
        if self.process is None:
            return
        _stop_process(self.process)
        self.process = None
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
            self.log_path = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def flush(self) -> None:
        """Empty every database and forget the scripts, as if just started."""
        import redis

        client = redis.Redis(host=HOST, port=self.port, socket_timeout=10)
        try:
            client.flushall()
            client.script_flush()
        finally:
            client.close()

    def restart(self, timeout: float = 10.0) -> None:
        """Stop and start again on the same port (the data is gone: nothing is saved)."""
        self.stop()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.start(timeout=max(0.5, deadline - time.monotonic()))
                return
            except ServiceError:
                # The port can linger briefly after the old process exits.
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)


def start_redis_server(timeout: float = 10.0) -> RedisServer:
    """Launch ``redis-server`` on a free port and wait until it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError("redis-server is not installed (not found on PATH)")
    server = RedisServer(port=free_port(), binary=binary)
    server.start(timeout=timeout)
    return server


@contextlib.contextmanager
def redis_url_for_tests() -> Iterator[str]:
    """A Redis URL: ``AP_TEST_REDIS_URL`` (a database of this worker's own) or a fresh
    ``redis-server``."""
    override = os.environ.get(REDIS_URL_ENV)
    if override:
        yield per_worker_database(override)
        return
    server = start_redis_server()
    try:
        yield server.url
    finally:
        server.stop()


# ------------------------------------------------------------ DynamoDB fault proxy


class DynamoFaultProxy:
    """An HTTP proxy in front of a DynamoDB endpoint that injects faults on demand.

    It speaks the AWS JSON protocol generically, so it also stands in front of
    moto's SQS (``AmazonSQS.*`` targets) and DynamoDB Streams.

    moto never throttles and never leaves BatchWriteItem items unprocessed, so
    tests point a store at this proxy instead and arm it:

    - ``fail_next(n, code, status)``: the next ``n`` requests get that error
      (for example ``ThrottlingException`` with 400, ``InternalServerError``
      with 500) without reaching the upstream.
    - ``unprocessed_rounds = n``: the next ``n`` BatchWriteItem calls forward only
      the first half of their items and return the rest as ``UnprocessedItems``.

    ``operations`` records the DynamoDB operation name of every request seen and
    ``batch_sizes`` the number of items of every BatchWriteItem. Like DynamoDB
    (and unlike moto), it refuses a BatchWriteItem of more than 25 items.
    Runs in the caller's event loop: ``await proxy.start()`` / ``await proxy.stop()``.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.operations: list[str] = []
        self.batch_sizes: list[int] = []
        self.unprocessed_rounds = 0
        self._failures: list[tuple[str, int]] = []
        self._operation_failures: dict[str, list[tuple[str, int]]] = {}
        self._outage: tuple[str, int] | None = None
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

    def fail_all(self, code: str = "InternalServerError", status: int = 500) -> None:
        """An outage: every request fails until ``recover()``; the upstream keeps its data."""
        self._outage = (code, status)

    def recover(self) -> None:
        self._outage = None
        self._failures.clear()
        self._operation_failures.clear()

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

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        target = request.headers.get("X-Amz-Target", "")
        operation = target.rpartition(".")[2]
        self.operations.append(operation)
        body = await request.read()

        def error(code: str, status: int, message: str) -> Any:
            payload = {"__type": f"com.amazonaws.dynamodb.v20120810#{code}", "message": message}
            return web.Response(
                status=status,
                body=json.dumps(payload).encode(),
                content_type="application/x-amz-json-1.0",
            )

        if self._outage is not None:
            code, status = self._outage
            return error(code, status, f"injected outage: {code}")
        if self._failures:
            code, status = self._failures.pop(0)
            return error(code, status, f"injected {code}")
        if self._operation_failures.get(operation):
            code, status = self._operation_failures[operation].pop(0)
            return error(code, status, f"injected {code}")
        if operation == "BatchWriteItem":
            size = sum(len(r) for r in json.loads(body).get("RequestItems", {}).values())
            self.batch_sizes.append(size)
            if size > 25:
                return error(
                    "ValidationException",
                    400,
                    "Too many items requested for the BatchWriteItem call",
                )
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
        headers = {
            name: value
            for name, value in request.headers.items()
            if name.lower() not in ("host", "content-length", "transfer-encoding")
        }
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body
        ) as upstream:
            status = upstream.status
            content = await upstream.read()
            content_type = upstream.headers.get("Content-Type", "application/x-amz-json-1.0")
        if held_back and status == 200:
            document = json.loads(content)
            document["UnprocessedItems"] = held_back
            content = json.dumps(document).encode()
        # botocore checks x-amz-crc32 when present, so it is not copied from upstream.
        return web.Response(status=status, body=content, headers={"Content-Type": content_type})
