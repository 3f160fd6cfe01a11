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

from loadtest.harness.faults import DynamoFaultProxy as DynamoFaultProxy
from loadtest.harness.servers import REPO_ROOT, redis_ping

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


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (IPv4), from ``/proc``: proof that a
    port is its own, where an answer on that port could come from any process that
    bound it after a race for a free port."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # exited
        return set()
    inodes: set[str] = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile (listdir's own, for one)
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports: set[int] = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            listening = fields[3] == "0A"
            if listening and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


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
    # moto behind the launcher that makes its DynamoDB requests atomic, as DynamoDB's are.
    return [sys.executable, "-m", "loadtest.harness.moto_server", "-H", HOST, "-p", str(port)]


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
        cwd=REPO_ROOT,
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


PORT_ATTEMPTS = 3


def start_redis_server(timeout: float = 10.0) -> RedisServer:
    """Launch ``redis-server`` on a free port and wait until it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError("redis-server is not installed (not found on PATH)")
    # A free port is picked, then bound by redis-server: a parallel test may take it
    # in between, and then another is picked.
    for attempt in range(1, PORT_ATTEMPTS + 1):
        server = RedisServer(port=free_port(), binary=binary)
        try:
            server.start(timeout=timeout)
        except ServiceError as exc:
            if "Address already in use" not in str(exc) or attempt == PORT_ATTEMPTS:
                raise
        else:
            return server
    raise AssertionError("unreachable")


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
