"""Services started on a picked free port tell a port another process took in between
from other failures: that one is retried on other ports, the rest fail at once."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.harness.redis_cluster import Instance, PortTaken
from loadtest.harness.servers import HOST, StartError, _start_redis_on
from tests.services import RedisServer, ServiceError, listening_ports


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_cluster_instance_on_a_taken_port_raises_port_taken(
    taken_port: int, tmp_path: Path
) -> None:
    instance = Instance(taken_port, tmp_path / str(taken_port))
    with pytest.raises(PortTaken, match="Address already in use"):
        instance.start(timeout=10)
    assert not instance.alive


def test_the_tests_redis_on_a_taken_port_says_so(taken_port: int) -> None:
    binary = shutil.which("redis-server")
    assert binary is not None
    server = RedisServer(port=taken_port, binary=binary)
    with pytest.raises(ServiceError, match="Address already in use"):
        server.start(timeout=10)


async def test_the_load_tests_redis_on_a_taken_port_says_so(taken_port: int) -> None:
    with pytest.raises(StartError, match="Address already in use"):
        await _start_redis_on(taken_port, 10)


def test_listening_ports_are_the_processs_own_listeners_only() -> None:
    # The cluster harness takes a node as ready only on ports it listens on itself.
    with socket.socket() as listener, socket.socket() as other:
        listener.bind((HOST, 0))
        listener.listen()
        port = listener.getsockname()[1]
        other.bind((HOST, 0))  # bound, not listening
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD_LISTENS],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            childs = int(child.stdout.readline())
            mine = listening_ports(os.getpid())
            assert port in mine
            assert other.getsockname()[1] not in mine
            assert childs not in mine
            assert childs in listening_ports(child.pid)
        finally:
            child.kill()
            child.wait()
    assert listening_ports(child.pid) == set()  # gone


CHILD_LISTENS = """
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
sys.stdin.read()
"""
