"""Start and stop the processes under test: our server, the baseline, Redis and moto.

Every process listens on a free port of 127.0.0.1, writes its output to a
log file (shown when it fails to start), and is stopped by ``stop()``:
SIGTERM, then SIGKILL after a grace period. Children inherit the parent's
raised file-descriptor limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.clients.http import get
from loadtest.harness.procstat import cpu_seconds, rss_bytes, run_delay_seconds

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout: children run there, with it on their path (loadtest/ is not installed)."""
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


PR_SET_PDEATHSIG = 1


class StartError(RuntimeError):
    """A process under test did not come up."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: ours, minus ``AP_*`` settings, plus the repo on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AP_")}
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    if extra:
        env.update(extra)
    return env


@dataclass
class Proc:
    """A child process and where it listens."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    ws_port: int = 0
    http_port: int = 0
    extra_pids: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def cpu_wait(self) -> float:
        return run_delay_seconds(self.pid)

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 8.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the load tester dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _spawn(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Proc:
    log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,  # a Ctrl-C at the terminal reaches us, not them
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    return Proc(name=name, process=process, log_path=log_path)


async def _wait_http(proc: Proc, port: int, path: str, limit: float) -> None:
    deadline = time.monotonic() + limit
    last = ""
    while time.monotonic() < deadline:
        if not proc.running():
            raise StartError(f"{proc.name} exited during start:\n{proc.log_tail()}")
        try:
            status, body = await get(HOST, port, path, limit=2.0)
        except (OSError, TimeoutError, Exception) as exc:  # not listening yet
            last = str(exc)
        else:
            if status == 200:
                return
            last = f"HTTP {status} {body[:200]!r}"
        await asyncio.sleep(0.1)
    raise StartError(f"{proc.name} was not ready in {limit:.0f} s ({last}):\n{proc.log_tail()}")


@dataclass(frozen=True)
class Secrets:
    jwt: str
    publish: str

    @classmethod
    def generate(cls) -> Secrets:
        return cls(jwt="loadtest-" + uuid.uuid4().hex * 2, publish=uuid.uuid4().hex)


def log_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "ap-loadtest-logs"
    path.mkdir(exist_ok=True)
    return path


async def start_ours(
    name: str,
    secrets: Secrets,
    *,
    debounce_ms: int,
    extra_args: list[str] | None = None,
    cluster: tuple[str, str, str] | None = None,
    limit: float = 60.0,
    ports: tuple[int, int] | None = None,
) -> Proc:
    """Our server as a subprocess: ``python -m server serve ...``.

    ``cluster`` is ``(redis_url, dynamodb_endpoint, table)`` for a cluster node;
    a ``redis_url`` naming several ``redis://`` nodes (comma-separated) is a
    Redis Cluster, passed as ``--redis-cluster-url``.
    ``ports`` (WebSocket, HTTP) restarts a node where its clients look for it.
    """
    ws_port, http_port = ports if ports is not None else (free_port(), free_port())
    argv = [
        sys.executable,
        "-m",
        "server",
        "serve",
        "--host",
        HOST,
        "--port",
        str(ws_port),
        "--http-host",
        HOST,
        "--http-port",
        str(http_port),
        "--node-id",
        name,
        "--dev-jwt-secret",
        secrets.jwt,
        "--publish-secret",
        secrets.publish,
        "--presence-debounce-ms",
        str(debounce_ms),
        "--log-level",
        "WARNING",
    ]
    env = child_env()
    if cluster is not None:
        redis_url, endpoint, table = cluster
        flag = "--redis-cluster-url" if "," in redis_url else "--redis-url"
        argv += [flag, redis_url, "--dynamodb-endpoint", endpoint, "--table", table]
        for key, value in FAKE_AWS.items():
            env.setdefault(key, value)
    argv += extra_args or []
    return await _started(name, argv, env, ws_port, http_port, limit)


async def start_baseline(secrets: Secrets, limit: float = 30.0) -> Proc:
    """The baseline server (``loadtest/harness/baseline_server.py``) as a subprocess."""
    ws_port, http_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "loadtest.harness.baseline_server",
        "--port",
        str(ws_port),
        "--http-port",
        str(http_port),
        "--publish-secret",
        secrets.publish,
    ]
    return await _started("baseline", argv, child_env(), ws_port, http_port, limit)


async def _started(
    name: str, argv: list[str], env: dict[str, str], ws_port: int, http_port: int, limit: float
) -> Proc:
    """Spawn a server and wait until its ``/readyz`` answers; stop it if it never does."""
    proc = _spawn(name, argv, env, log_dir())
    proc.ws_port, proc.http_port = ws_port, http_port
    try:
        await _wait_http(proc, http_port, "/readyz", limit)
    except BaseException:
        proc.stop()
        raise
    return proc


def redis_ping(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    """True when a Redis server on ``host:port`` answers PING with PONG."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"PING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    break
                reply += chunk
            return reply.startswith(b"+PONG")
    except OSError:
        return False


async def start_redis(limit: float = 15.0, port: int | None = None) -> tuple[Proc, str]:
    """An empty ``redis-server`` without persistence; ``port`` restarts one in place."""
    if port is not None:
        return await _start_redis_on(port, limit)
    # A free port is picked, then bound by redis-server: another process may take it
    # in between, and then another is picked.
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return await _start_redis_on(free_port(), limit)
        except StartError as exc:
            if "Address already in use" not in str(exc) or attempt == PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3


async def _start_redis_on(port: int, limit: float) -> tuple[Proc, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise StartError("redis-server is not on PATH")
    argv = [binary, "--save", "", "--appendonly", "no", "--bind", HOST, "--port", str(port)]
    proc = _spawn("redis", argv, child_env(), log_dir())
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not proc.running():
            raise StartError(f"redis-server exited:\n{proc.log_tail()}")
        # Bounded: whatever holds the port may accept and never answer.
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(1.0):
                reader, writer = await asyncio.open_connection(HOST, port)
                try:
                    writer.write(b"PING\r\n")
                    reply = await reader.readline()
                finally:
                    writer.close()
            if reply.startswith(b"+PONG"):
                return proc, f"redis://{HOST}:{port}/0"
        await asyncio.sleep(0.1)
    proc.stop()
    raise StartError(f"redis-server did not answer PING:\n{proc.log_tail()}")


async def redis_used_memory(url: str, limit: float = 5.0) -> int:
    """``used_memory`` from ``INFO memory`` of the Redis at ``redis://host:port/db``."""
    host, _, port = url.removeprefix("redis://").split("/")[0].rpartition(":")
    async with asyncio.timeout(limit):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"INFO memory\r\n")
            head = await reader.readline()  # $<length>
            if not head.startswith(b"$"):
                raise StartError(f"unexpected INFO reply {head!r}")
            body = await reader.readexactly(int(head[1:]) + 2)
        finally:
            writer.close()
    for line in body.splitlines():
        if line.startswith(b"used_memory:"):
            return int(line.split(b":", 1)[1])
    raise StartError("INFO memory has no used_memory")


async def start_moto(limit: float = 60.0) -> tuple[Proc, str]:
    if importlib.util.find_spec("moto") is None:
        raise StartError("moto is not installed (pip install 'moto[server]')")
    port = free_port()
    env = child_env(FAKE_AWS)
    # moto behind the launcher that makes its DynamoDB requests atomic, as DynamoDB's are.
    argv = [sys.executable, "-m", "loadtest.harness.moto_server", "-H", HOST, "-p", str(port)]
    proc = _spawn("moto", argv, env, log_dir())
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not proc.running():
            raise StartError(f"moto_server exited:\n{proc.log_tail()}")
        with contextlib.suppress(Exception):
            status, _ = await get(HOST, port, "/moto-api/", limit=2.0)
            if status < 500:
                return proc, f"http://{HOST}:{port}"
        await asyncio.sleep(0.2)
    proc.stop()
    raise StartError(f"moto_server did not start:\n{proc.log_tail()}")


async def create_table(endpoint: str, table: str, limit: float = 60.0) -> None:
    argv = [
        sys.executable,
        "-m",
        "server",
        "create-table",
        "--dynamodb-endpoint",
        endpoint,
        "--table",
        table,
    ]
    env = child_env(FAKE_AWS)
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=REPO_ROOT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), limit)
    except TimeoutError:
        process.kill()
        raise StartError("create-table timed out") from None
    if process.returncode != 0:
        raise StartError(f"create-table failed:\n{output.decode(errors='replace')}")
