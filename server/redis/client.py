"""Command clients for one Redis or a Redis Cluster, and retrying through a failover.

Every part that talks to Redis (the buses, streams, presence, dedup, leases,
locks, rate limits, claims) makes its clients here, so they all fail fast the
same way instead of hanging while Redis is away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from server.redis.shard_pipes import FAILOVER_BACKOFF
from server.runtime.backoff import Retrying
from server.runtime.metrics import Counter

T = TypeVar("T")

MAX_CONNECTIONS = 64
"""Per cluster node, for the command clients of the services (presence, chat
locks, rate limits); redis-py's cluster pool raises instead of waiting when
it is exhausted."""


class RedisUnavailable(ConnectionError):
    """Redis could not be reached at start-up within the allowed time."""


def make_client(
    url: str, *, retries: int = 1, max_connections: int = 32, client_name: str | None = None
) -> aioredis.Redis:
    """A command client that fails fast instead of hanging while Redis is away.

    Callers beyond ``max_connections`` wait for a free connection (up to the
    socket timeout) rather than fail.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=5.0,
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
        health_check_interval=0,
        retry=Retry(NoBackoff(), retries),
        client_name=client_name,
    )
    client: aioredis.Redis = aioredis.Redis.from_pool(pool)
    return client


def subscriber_connection(url: str, *, client_name: str | None) -> AbstractConnection:
    """An unconnected connection for :class:`~server.redis.subscriber.Subscriber`:
    the URL's meaning (TLS, credentials, database) is the command clients'."""
    pool = aioredis.ConnectionPool.from_url(
        url,
        socket_connect_timeout=2.0,
        socket_timeout=5.0,  # the handshake's; the subscriber reads without one
        health_check_interval=0,
        retry=Retry(NoBackoff(), 0),
        client_name=client_name,
    )
    connection: AbstractConnection = pool.make_connection()  # type: ignore[no-untyped-call]
    return connection


def startup_nodes(url: str) -> list[ClusterNode]:
    """Seed nodes from ``redis://h1:p1[,redis://h2:p2...]`` (or bare ``h:p`` entries)."""
    nodes = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        parsed = urlsplit(part if "://" in part else "redis://" + part)
        if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
            raise ValueError(f"not a Redis Cluster node URL: {part!r}")
        nodes.append(ClusterNode(parsed.hostname, parsed.port or 6379))
    if not nodes:
        raise ValueError("--redis-cluster-url names no node")
    return nodes


def make_cluster_client(url: str, *, max_connections: int = MAX_CONNECTIONS) -> RedisCluster:
    """A command client for the cluster that follows MOVED and failovers."""
    return RedisCluster(
        startup_nodes=startup_nodes(url),
        max_connections=max_connections,
        socket_connect_timeout=1.0,
        socket_timeout=5.0,
        health_check_interval=0,
        retry=Retry(NoBackoff(), 3),
    )


def command_client_for(url: str, *, cluster: bool) -> Any:
    """A command client for a service: on a Redis Cluster (``--redis-cluster-url``) or one Redis."""
    if cluster:
        return make_cluster_client(url)
    return make_client(url, retries=1)


async def through_failover(
    call: Callable[[], Awaitable[T]],
    deadline: float,
    closing: Callable[[], bool] = lambda: False,
    retries: Counter | None = None,
) -> T:
    """Run ``call`` on the command client, retrying while a shard fails over,
    until ``deadline`` (``time.monotonic()``).

    A killed primary refuses connections until its replica is promoted (about
    ``cluster-node-timeout`` plus an election); redis-py then finds the new
    owner by itself. Retrying turns the failover into a delay, not a loss. (The
    streams and the bus use ``ShardPipes``, which retry the same way.) Each retry
    counts on ``retries`` (the bus's ``ap_bus_failover_retries_total``).
    """
    retrying: Retrying | None = None
    while True:
        try:
            return await call()
        except (RedisError, OSError, AttributeError, RuntimeError):
            # redis-py 8.1's cluster client re-reads the slot map after a node
            # fails and closes connections that other commands are about to
            # write on ("handler is closed", a None writer): nothing was sent,
            # so those are retried like a refused connection.
            if retrying is None:
                retrying = FAILOVER_BACKOFF.start(deadline=deadline)
            delay = None if closing() else retrying.next_delay()
            if delay is None:
                raise
            if retries is not None:
                retries.inc()
            await asyncio.sleep(delay)
