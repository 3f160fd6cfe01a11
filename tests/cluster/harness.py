"""A real cluster for tests: server nodes as separate processes, one Redis, one table.

Every node is ``python -m server serve`` on 127.0.0.1 with ports of its own,
talking to a ``redis-server`` the test started (so the test may restart it),
or to a six-instance Redis Cluster (``--redis-cluster-url``), and to a
DynamoDB table of its own. Timings are short so that failures are
detected in seconds; :data:`TIMINGS` lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as ClusterClient

from loadtest.harness.redis_cluster import RedisCluster
from server.presence.redis import lease_ms_for
from server.redis.client import make_cluster_client
from server.store.base import ConnectionRecord
from server.store.dynamodb import DynamoStore
from tests.client import DEV_SECRET, Client
from tests.services import HOST, RedisServer, free_port, listening_ports
from tests.waiting import eventually

PUBLISH_SECRET = "cluster-publish-secret"
REGION = "us-east-1"
ROOT = Path(__file__).resolve().parents[2]

DEBOUNCE_MS = 300
HEARTBEAT_MS = 500
TIMEOUT_MS = 3000
LEASE_MS = lease_ms_for(HEARTBEAT_MS)
DRAIN_SECONDS = 0.5
DRAIN_MOVE_GRACE_MS = 300
TIMINGS = {
    "presence_debounce_ms": DEBOUNCE_MS,
    "node_heartbeat_ms": HEARTBEAT_MS,
    "node_timeout_ms": TIMEOUT_MS,
    "drain_seconds": DRAIN_SECONDS,
    "drain_move_grace_ms": DRAIN_MOVE_GRACE_MS,
}

DEATH_BOUND = (TIMEOUT_MS + HEARTBEAT_MS + DEBOUNCE_MS) / 1000
"""The promised time from a node's death to its users' leaves (docs/cluster.md)."""
CLEAN_STOP_BOUND = DRAIN_SECONDS + (DRAIN_MOVE_GRACE_MS + 2 * DEBOUNCE_MS) / 1000
"""From SIGTERM to the leaves of a stopped node's users who did not come back."""
STOP_BOUND = 60.0
"""How long a node may take to exit on SIGTERM at the end of a test (a drain of
DRAIN_SECONDS, then the stop): past it the node is killed and the test fails."""
SLACK = 30.0
"""Added to every promised time to make a test's deadline: a hang guard for a
two-core machine that five test runs share, never the thing measured. A test that
checks a promised time checks it by cause (the path that would take longer is
made far longer than the deadline), not by a stopwatch."""


@dataclass
class NodeProcess:
    name: str
    port: int
    http_port: int
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def ws_url(self) -> str:
        return f"ws://{HOST}:{self.port}/"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""


@dataclass
class Cluster:
    redis: RedisServer | RedisCluster
    dynamodb_endpoint: str
    table: str
    workdir: Path
    nodes: dict[str, NodeProcess] = field(default_factory=dict)
    clients: list[Client] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    """Nodes that did not exit on SIGTERM (killed after the bound)."""
    _http: aiohttp.ClientSession | None = None

    # --- nodes --------------------------------------------------------------

    def _unused_port(self, *taken: int) -> int:
        """A free port no other node of this cluster was given: a port picked and
        released may be picked again before its node binds it, and then a node's
        readyz would be answered by another node while it exits on the bind."""
        given = set(taken)
        for other in self.nodes.values():
            given |= {other.port, other.http_port}
        while (port := free_port()) in given:
            pass
        return port

    def spawn(self, name: str, **overrides: Any) -> NodeProcess:
        settings: dict[str, Any] = {**TIMINGS, **overrides}
        node = self.nodes.get(name)
        port = node.port if node is not None else self._unused_port()
        http_port = node.http_port if node is not None else self._unused_port(port)
        args = [
            sys.executable,
            "-m",
            "server",
            "serve",
            "--node-id",
            name,
            "--host",
            HOST,
            "--port",
            str(port),
            "--http-host",
            HOST,
            "--http-port",
            str(http_port),
            *self.redis_args(),
            "--dynamodb-endpoint",
            self.dynamodb_endpoint,
            "--table",
            self.table,
            "--dev-jwt-secret",
            DEV_SECRET,
            "--publish-secret",
            PUBLISH_SECRET,
        ]
        for key, value in settings.items():
            args += ["--" + key.replace("_", "-"), str(value)]
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.nodes[name] = NodeProcess(name, port, http_port, log_path, process)
        return self.nodes[name]

    def redis_args(self) -> list[str]:
        if isinstance(self.redis, RedisCluster):
            return ["--redis-cluster-url", self.redis.url]
        return ["--redis-url", self.redis.url]

    def redis_client(self) -> aioredis.Redis | ClusterClient:
        """A command client for the Redis (or Redis Cluster) the nodes use."""
        if isinstance(self.redis, RedisCluster):
            return make_cluster_client(self.redis.url)
        return aioredis.Redis.from_url(self.redis.url)

    async def start(self, *names: str, within: float = 90.0, **overrides: Any) -> None:
        """Spawn the named nodes (with ``overrides`` of their settings) and wait for each."""
        for name in names:
            self.spawn(name, **overrides)
        for name in names:
            try:
                await self.wait_ready(name, within)
            except AssertionError:
                # A free port taken by someone else (a Redis Cluster's outgoing
                # connections use the same range) before the node bound it: once
                # more on fresh ports.
                if "address already in use" not in self.nodes[name].log():
                    raise
                del self.nodes[name]
                self.spawn(name, **overrides)
                await self.wait_ready(name, within)

    async def wait_ready(self, name: str, within: float = 90.0) -> None:
        """Until the node answers /readyz with 200 on ports it owns itself: after a
        lost race for a free port, another test's node may hold its HTTP port and
        answer for it while it exits on the bind."""
        node = self.nodes[name]
        deadline = time.monotonic() + within
        while await self.readyz(name) != 200 or not {node.port, node.http_port} <= (
            listening_ports(node.process.pid)
        ):
            if not node.alive:
                raise AssertionError(f"node {name} exited:\n{node.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"node {name} not ready in {within:g}s:\n{node.log()}")
            await asyncio.sleep(0.1)

    def kill(self, name: str) -> None:
        """kill -9: no goodbye to Redis, DynamoDB or the clients."""
        node = self.nodes[name]
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=10)

    async def terminate(self, name: str, within: float = STOP_BOUND) -> None:
        """SIGTERM, then wait (off the loop: the node closes our clients meanwhile)."""
        node = self.nodes[name]
        if not node.alive:
            return
        node.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(node.process.wait, within)
        except subprocess.TimeoutExpired:
            # A node that will not stop: its tasks' stacks into its log, for the failure.
            with contextlib.suppress(OSError):
                node.process.send_signal(signal.SIGUSR1)
            await asyncio.sleep(1)
            node.process.kill()
            node.process.wait(timeout=10)
            self.hung.append(name)

    # --- HTTP ---------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self._http

    async def readyz(self, name: str) -> int | None:
        try:
            async with self._session().get(self.nodes[name].http_url + "/readyz") as response:
                return response.status
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def metric(self, name: str, metric: str) -> float:
        """One counter or gauge from node ``name``'s /metrics (0 when absent)."""
        async with self._session().get(self.nodes[name].http_url + "/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith(metric + " "):
                return float(line.split()[1])
        return 0.0

    async def publish(self, name: str, body: dict[str, Any]) -> int:
        status, _ = await self.publish_reply(name, body)
        return status

    async def publish_reply(self, name: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST /publish on node ``name``: the status and the decoded JSON reply."""
        async with self._session().post(
            self.nodes[name].http_url + "/publish",
            json=body,
            headers={"Authorization": f"Bearer {PUBLISH_SECRET}"},
        ) as response:
            text = await response.read()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, text.decode(errors="replace")

    # --- clients ------------------------------------------------------------

    async def client(self, name: str, user_id: str, **subscribe: Any) -> Client:
        """A client on node ``name``, subscribed (snapshot received) as ``user_id``."""
        client = await Client.open(self.nodes[name].ws_url)
        self.clients.append(client)
        await client.subscribe(user_id, **subscribe)
        return client

    async def close_client(self, client: Client) -> None:
        with contextlib.suppress(Exception):
            await client.close()

    # --- shared state ---------------------------------------------------------

    async def leader(self) -> str | None:
        """The node holding the presence writer lease, read from Redis."""
        client = self.redis_client()
        try:
            token = await client.get("ap:{presence}:leader")
        finally:
            await client.aclose()
        if token is None:
            return None
        text = token.decode() if isinstance(token, bytes) else token
        return str(text).split("/", 1)[0]

    async def wait_leader(self, within: float = 10.0, other_than: str | None = None) -> str:
        deadline = time.monotonic() + within
        while True:
            leader = await self.leader()
            if leader is not None and leader != other_than:
                return leader
            if time.monotonic() > deadline:
                raise AssertionError(f"no presence writer (other than {other_than}) in {within}s")
            await asyncio.sleep(0.1)

    async def rows(self) -> list[ConnectionRecord]:
        store = DynamoStore(table=self.table, region=REGION, endpoint_url=self.dynamodb_endpoint)
        await store.start()
        try:
            return await store.list_connections()
        finally:
            await store.close()

    async def presence_seq(self) -> int:
        store = DynamoStore(table=self.table, region=REGION, endpoint_url=self.dynamodb_endpoint)
        await store.start()
        try:
            return await store.current_presence_seq()
        finally:
            await store.close()

    # --- teardown -----------------------------------------------------------

    def logs(self) -> str:
        return "\n".join(f"===== {name}\n{node.log()}" for name, node in self.nodes.items())

    async def close(self) -> None:
        for client in self.clients:
            await self.close_client(client)
        running = [name for name, node in self.nodes.items() if node.alive]
        for name in running:
            with contextlib.suppress(OSError):
                self.nodes[name].process.send_signal(signal.SIGCONT)  # a paused one too
        # All at once: each drains for DRAIN_SECONDS, and none waits for another.
        await asyncio.gather(*(self.terminate(name, STOP_BOUND) for name in running))
        if self._http is not None:
            await self._http.close()
        # A node that does not exit on SIGTERM is a bug (its tasks are in its log).
        assert not self.hung, "did not stop on SIGTERM: " + "\n".join(
            f"===== {name}\n{self.nodes[name].log(20_000)}" for name in self.hung
        )


def new_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ap-cluster-"))


def remove_workdir(path: Path) -> None:
    for child in path.iterdir():
        with contextlib.suppress(OSError):
            child.unlink()
    with contextlib.suppress(OSError):
        os.rmdir(path)


async def wait_visible(client: Client, expected: set[str], within: float, what: str) -> None:
    """Wait until ``client`` shows exactly ``expected`` as visible."""
    await eventually(lambda: client.presence.visible == expected, within, what)
