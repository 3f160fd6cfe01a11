"""A real local Redis Cluster for tests and load tests, built from ``redis-server`` only.

Six instances on free ports of 127.0.0.1, each with ``--cluster-enabled yes``,
joined by ``redis-cli --cluster create ... --cluster-replicas 1`` into three
primaries with one replica each. :meth:`RedisCluster.start` returns once
every instance reports ``cluster_state:ok`` and agrees on who owns all 16384
slots; :meth:`stop` kills them and removes their directory.

The node timeout is short (1 s) so that a killed primary fails over in about
two seconds: tests wait for it, so it sets their pace. Nothing is persisted
(no RDB, no AOF): a restarted instance comes back empty, as after a crash
with persistence off, which is the harder case for the server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.harness.servers import HOST, StartError, free_port, redis_ping

NODE_TIMEOUT_MS = 1000
SIZE = 6


def redis_cli(port: int, *args: str, timeout: float = 2.0) -> str:
    """One command through ``redis-cli``; its output, or "" if the instance is away."""
    try:
        done = subprocess.run(
            ["redis-cli", "-h", HOST, "-p", str(port), *args],
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout.decode(errors="replace")


class PortTaken(StartError):
    """Another process bound the port between our pick and the instance's start."""


@dataclass
class Instance:
    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                HOST,
                "--port",
                str(self.port),
                "--dir",
                str(self.directory),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                # A replica may take over only if its data is recent; it hears
                # from its primary every second, so it always is.
                "--repl-ping-replica-period",
                "1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not redis_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = (self.directory / "redis.log").read_text(errors="replace")[-600:]
                error = PortTaken if "Address already in use" in tail else StartError
                raise error(f"cluster instance on port {self.port} did not start:\n{tail}")
            time.sleep(0.02)

    def kill(self) -> None:
        """kill -9: no goodbye to the cluster or its clients."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None


@dataclass
class RedisCluster:
    instances: list[Instance]
    workdir: Path

    @property
    def url(self) -> str:
        """The ``--redis-cluster-url`` value: every instance, as startup nodes."""
        return ",".join(f"redis://{i.address}" for i in self.instances)

    def instance(self, port: int) -> Instance:
        return next(i for i in self.instances if i.port == port)

    # --- lifecycle ----------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        for instance in self.instances:
            instance.start(timeout)
        addresses = [i.address for i in self.instances]
        replicas = ["--cluster-replicas", "1", "--cluster-yes"]
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, *replicas],
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if created.returncode != 0:
            self.stop()
            raise StartError(f"redis-cli --cluster create failed: {created.stdout!r}")
        self.wait_ok(timeout)

    def stop(self) -> None:
        for instance in self.instances:
            with contextlib.suppress(Exception):
                instance.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restart_all(self, timeout: float = 60.0) -> None:
        """Kill every instance and start them again: the cluster re-forms from nodes.conf."""
        for instance in self.instances:
            instance.kill()
        for instance in self.instances:
            instance.start()
        self.wait_ok(timeout)

    def flush(self) -> None:
        """Empty every primary, so a test starts from a cluster without keys."""
        for port in self.primaries():
            redis_cli(port, "flushall")

    def pids(self) -> list[int]:
        return [i.process.pid for i in self.instances if i.process is not None and i.alive]

    def cpu_seconds(self) -> float:
        """User + system CPU of the live instances (Linux ``/proc``), for the load test."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for instance in self.instances:
            if instance.process is None or not instance.alive:
                continue
            with contextlib.suppress(OSError):
                with open(f"/proc/{instance.process.pid}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / ticks
        return total

    # --- state --------------------------------------------------------------

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live instance says ``cluster_state:ok`` with all slots served."""
        deadline = time.monotonic() + timeout
        while True:
            if all(self._ok(i.port) for i in self.instances if i.alive):
                return
            if time.monotonic() > deadline:
                states = {i.port: redis_cli(i.port, "cluster", "info")[:80] for i in self.instances}
                raise StartError(f"Redis Cluster not ok after {timeout}s: {states}")
            time.sleep(0.1)

    @staticmethod
    def _ok(port: int) -> bool:
        info = redis_cli(port, "cluster", "info")
        if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
            return False
        # A replica that has not synced yet could not take over from its primary.
        replication = redis_cli(port, "info", "replication")
        return "role:slave" not in replication or "master_link_status:up" in replication

    def primaries(self) -> list[int]:
        """Ports of the live primaries, as the cluster sees them now."""
        for instance in self.instances:
            if instance.alive:
                ports = []
                for line in redis_cli(instance.port, "cluster", "nodes").splitlines():
                    parts = line.split()
                    flags = parts[2] if len(parts) > 8 else ""
                    if "master" in flags and "fail" not in flags and parts[7] == "connected":
                        ports.append(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
                if ports:
                    return sorted(ports)
        return []

    def owner(self, slot: int) -> int:
        """Port of the primary serving ``slot`` now."""
        for instance in self.instances:
            if not instance.alive:
                continue
            for line in redis_cli(instance.port, "cluster", "nodes").splitlines():
                parts = line.split()
                if len(parts) < 9 or "master" not in parts[2] or "fail" in parts[2]:
                    continue
                for spec in parts[8:]:
                    if spec.startswith("["):
                        continue
                    low, _, high = spec.partition("-")
                    if int(low) <= slot <= int(high or low):
                        return int(parts[1].split("@")[0].rsplit(":", 1)[1])
        raise StartError(f"no live primary serves slot {slot}")

    def wait_failover(self, dead_port: int, slot: int, timeout: float = 30.0) -> int:
        """Until a live primary other than ``dead_port`` serves ``slot``; its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(StartError):
                port = self.owner(slot)
                if port != dead_port:
                    self.wait_ok(max(1.0, deadline - time.monotonic()))
                    return port
            time.sleep(0.1)
        raise StartError(f"slot {slot} did not fail over from {dead_port} in {timeout}s")

    # --- resharding: one slot moved by hand, step by step --------------------

    def node_id(self, port: int) -> str:
        return redis_cli(port, "cluster", "myid").strip()

    def begin_migration(self, slot: int, source: int, target: int) -> None:
        """``SETSLOT IMPORTING`` on the target, then ``MIGRATING`` on the source."""
        for port, state, other in ((target, "importing", source), (source, "migrating", target)):
            reply = redis_cli(port, "cluster", "setslot", str(slot), state, self.node_id(other))
            if reply.strip() != "OK":
                raise StartError(f"SETSLOT {slot} {state} on {port}: {reply!r}")

    def move_keys(self, slot: int, source: int, target: int) -> int:
        """``MIGRATE`` every key of ``slot`` from ``source`` to ``target``; how many."""
        moved = 0
        while True:
            keys = redis_cli(source, "cluster", "getkeysinslot", str(slot), "100").split()
            if not keys:
                return moved
            reply = redis_cli(source, "migrate", HOST, str(target), "", "0", "5000", "keys", *keys)
            if reply.strip() not in ("OK", "NOKEY"):
                raise StartError(f"MIGRATE of slot {slot} to {target}: {reply!r}")
            moved += len(keys)

    def finish_migration(self, slot: int, target: int) -> None:
        """``SETSLOT NODE`` on the target first, then on every other primary."""
        target_id = self.node_id(target)
        for port in [target, *(p for p in self.primaries() if p != target)]:
            reply = redis_cli(port, "cluster", "setslot", str(slot), "node", target_id)
            if reply.strip() != "OK":
                raise StartError(f"SETSLOT {slot} NODE on {port}: {reply!r}")


def _redis_cli_available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


PORT_ATTEMPTS = 3


def start_redis_cluster(timeout: float = 60.0) -> RedisCluster:
    """Six ``redis-server`` instances joined into a cluster of 3 primaries + 3 replicas."""
    if not _redis_cli_available():
        raise StartError("redis-server and redis-cli are needed for a Redis Cluster")
    # Free ports are picked, then bound by redis-server: in between another process
    # (a parallel test, a load test) may take one. Then the cluster is picked anew.
    for attempt in range(1, PORT_ATTEMPTS + 1):
        workdir = Path(tempfile.mkdtemp(prefix="ap-rcluster-"))
        ports: list[int] = []
        while len(ports) < SIZE:
            port = free_port()
            # The cluster bus listens on port + 10000: both must be free.
            if port + 10000 < 65536 and port not in ports and _free(port + 10000):
                ports.append(port)
        cluster = RedisCluster([Instance(p, workdir / str(p)) for p in ports], workdir)
        try:
            cluster.start(timeout)
        except PortTaken:
            cluster.stop()
            if attempt == PORT_ATTEMPTS:
                raise
        except BaseException:
            cluster.stop()
            raise
        else:
            return cluster
    raise AssertionError("unreachable")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def redis_cluster_for_tests() -> Iterator[RedisCluster]:
    cluster = start_redis_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


__all__ = [
    "NODE_TIMEOUT_MS",
    "RedisCluster",
    "redis_cli",
    "redis_cluster_for_tests",
    "start_redis_cluster",
]
