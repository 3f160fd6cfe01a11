"""Which part does each job, chosen from settings: memory parts for the embedded
default, Redis and DynamoDB parts when configured, and the AWS bridges when asked.

Nothing here runs anything: ``build_node`` returns a node ready to ``start()``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from server.auth.jwks import jwks_source
from server.auth.verify import Authenticator, BotVerifier, CognitoVerifier, DevVerifier
from server.bus.memory import MemoryBus
from server.bus.streams import MemoryStreams
from server.bus.topics import PRESENCE
from server.config import Settings
from server.coordination.bot_sessions import MemoryBotSessions
from server.coordination.claims import MemoryClaims
from server.coordination.dedup import Dedup, MemoryDedup, RedisClusterDedup, RedisDedup
from server.coordination.game_lock import MemoryGameLocks
from server.coordination.lease import Lease, MemoryLease, RedisLease
from server.coordination.rate_limit import MemoryRateLimiter
from server.node import Node
from server.presence.core import MemoryPresenceBackend
from server.runtime.metrics import Registry, register_process
from server.services import Coordination
from server.services.chat import RATE_WINDOW_SECONDS
from server.store.base import Store
from server.store.memory import MemoryStore

if TYPE_CHECKING:  # the AWS parts load only when a flag asks for them
    from server.ingress.queue_core import QueuePolling


def build_authenticator(settings: Settings, metrics: Registry | None = None) -> Authenticator:
    cognito = None
    if settings.cognito_issuer is not None and settings.cognito_client_id is not None:
        cognito = CognitoVerifier(
            settings.cognito_issuer,
            settings.cognito_client_id,
            jwks_source(settings.cognito_issuer, settings.jwks_file, metrics),
        )
    bot = None
    if settings.bot_cognito_issuer is not None and settings.bot_scope is not None:
        bot = BotVerifier(
            settings.bot_cognito_issuer,
            settings.bot_scope,
            jwks_source(settings.bot_cognito_issuer, settings.bot_jwks_file, metrics),
        )
    dev = DevVerifier(settings.dev_jwt_secret) if settings.dev_jwt_secret else None
    return Authenticator(
        cognito=cognito, dev=dev, bot=bot, cache_size=settings.token_cache_size, metrics=metrics
    )


def build_store(settings: Settings, metrics: Registry | None = None) -> Store:
    if settings.store == "dynamodb":
        from server.store.dynamodb import DynamoStore

        return DynamoStore(
            table=settings.table,
            region=settings.region,
            endpoint_url=settings.dynamodb_endpoint,
            metrics=metrics,
        )
    store = MemoryStore()
    if settings.dev_bot is not None:
        from server.dev_bot import seed_memory

        seed_memory(store, settings.dev_bot)
    return store


async def build_node(settings: Settings, store: Store | None = None) -> Node:
    """A node ready to ``start()``: memory parts by default, shared ones when configured."""
    metrics = Registry()  # the node's own: every part built here counts on it
    register_process(metrics)
    if store is None:
        store = build_store(settings, metrics)
    build = _cluster_node if settings.clustered else _embedded_node
    node = build(settings, store, metrics)
    add_bridges(node, settings)
    return node


def _embedded_node(settings: Settings, store: Store, metrics: Registry) -> Node:
    bus = MemoryBus()
    streams = MemoryStreams(bus, settings.stream_limits)
    metrics.gauge(
        "ap_stream_history_bytes",
        "Event bytes kept in the streams' histories (embedded: in this process)",
        streams.history_bytes,
    )
    return Node(
        settings,
        store,
        bus,
        MemoryPresenceBackend(bus, store, settings.node_id),
        build_authenticator(settings, metrics),
        streams,
        memory_coordination(settings, metrics),
        metrics=metrics,
    )


def _cluster_node(settings: Settings, store: Store, metrics: Registry) -> Node:
    from server.bus.redis_bus import RedisBus
    from server.bus.redis_cluster_bus import RedisClusterBus
    from server.bus.redis_streams import RedisStreams
    from server.presence.redis import RedisPresenceBackend
    from server.routing.stream_audit import StreamAudit

    bus: RedisBus | RedisClusterBus
    if settings.redis_cluster_url is not None:
        bus = RedisClusterBus(settings.redis_cluster_url, name=settings.node_id, metrics=metrics)
        streams = RedisStreams.on_cluster(bus, settings.stream_limits)
    else:
        assert settings.redis_url is not None
        bus = RedisBus(settings.redis_url, name=settings.node_id, metrics=metrics)
        streams = RedisStreams(settings.redis_url, settings.stream_limits)
    backend = RedisPresenceBackend.from_settings(settings, bus, store, metrics)
    node = Node(
        settings,
        store,
        bus,
        backend,
        build_authenticator(settings, metrics),
        streams,
        redis_coordination(settings, metrics),
        metrics=metrics,
    )
    # After a Redis reconnect the node reloads presence and re-snapshots its
    # clients; if the cluster presumed it dead, it writes its rows again.
    bus.on_reconnect(node.presence.resync)
    # Events published meanwhile are in the streams' history: fill the holes.
    bus.on_reconnect(node.delivery.check_streams)
    # A delta the view check found lost may mean a dead subscription.
    node.presence.on_lost_delta(lambda: bus.recheck(PRESENCE))
    # The same for the streams this node holds (on a Redis Cluster, on other shards).
    if settings.stream_audit_seconds > 0:
        audit = StreamAudit(
            node.delivery,
            streams,
            metrics,
            on_missed=bus.recheck,
            interval=settings.stream_audit_seconds,
        )
        node.services.append(audit)
    backend.on_presumed_dead(lambda: node.registry.rewrite(node.sessions, node.node_id))
    return node


def memory_coordination(settings: Settings, metrics: Registry | None = None) -> Coordination:
    """The services' shared parts when this process is the whole cluster."""
    return Coordination(
        MemoryGameLocks(metrics=metrics),
        MemoryRateLimiter(settings.chat_rate, RATE_WINDOW_SECONDS),
        MemoryClaims(),
        MemoryBotSessions(settings.node_id),
    )


def redis_coordination(settings: Settings, metrics: Registry | None = None) -> Coordination:
    """The services' cluster-wide parts: per-game chat locks, the chat rate, lastSeen claims.

    Their keys carry the hash tag of a game or a user, one key per script, so
    they work unchanged on a Redis Cluster.
    """
    from server.coordination.bot_sessions import RedisBotSessions
    from server.coordination.claims import RedisClaims
    from server.coordination.game_lock import RedisGameLocks
    from server.coordination.rate_limit import RedisRateLimiter

    sharded = settings.redis_cluster_url is not None
    url = settings.redis_cluster_url if sharded else settings.redis_url
    assert url is not None
    return Coordination(
        RedisGameLocks(url, cluster=sharded, metrics=metrics),
        RedisRateLimiter(url, "chat", settings.chat_rate, RATE_WINDOW_SECONDS, cluster=sharded),
        RedisClaims(url, "last-seen", cluster=sharded),
        RedisBotSessions(url, settings.node_id, cluster=sharded),
    )


def queue_polling(settings: Settings, queue_url: str) -> QueuePolling:
    """Both queue bridges poll with the ``--sqs-*`` settings."""
    from server.ingress.queue_core import QueuePolling

    return QueuePolling(
        queue_url,
        node_id=settings.node_id,
        region=settings.region,
        endpoint_url=settings.sqs_endpoint,
        pollers=settings.sqs_pollers,
        wait_seconds=settings.sqs_wait_seconds,
        visibility_seconds=settings.sqs_visibility_seconds,
    )


def add_bridges(node: Node, settings: Settings) -> None:
    """The AWS inputs, each only when its flag is set: nothing polls AWS otherwise."""
    if settings.sqs_queue_url is not None:
        from server.ingress.sqs import SqsBridge

        node.services.append(
            SqsBridge(
                node.publish,
                node.bus,
                choose_dedup(node, settings),
                queue_polling(settings, settings.sqs_queue_url),
                metrics=node.metrics,
            )
        )
    if settings.bot_queue_url is not None and settings.bot_webhook_queue_url is not None:
        from server.ingress.bot_queue import BotQueueBridge

        # A client of its own on DynamoDB: its candidate writes hold a message's
        # delivery, and must not queue behind a reconnect storm's pendingTurns reads
        # for the node's connections (measured: 12-90 s behind them on one pool).
        own_store = settings.store == "dynamodb"
        node.services.append(
            BotQueueBridge(
                node.publish,
                node.bus,
                choose_dedup(node, settings),
                build_store(settings, node.metrics) if own_store else node.store,
                node.bots.sessions,
                queue_polling(settings, settings.bot_queue_url),
                settings.bot_webhook_queue_url,
                challenges_by_webhook=settings.bot_challenges_by_webhook,
                owns_store=own_store,
                metrics=node.metrics,
            )
        )
    if settings.notifications_from_stream:
        from server.ingress.notifications import LEASE_KEY, NotificationPush

        node.services.append(
            NotificationPush(
                node.publish,
                node.store,
                choose_lease(node, settings, LEASE_KEY),
                choose_dedup(node, settings),
                node_id=settings.node_id,
                table=settings.table,
                region=settings.region,
                endpoint_url=settings.dynamodb_endpoint,
                poll_seconds=settings.stream_poll_ms / 1000,
                metrics=node.metrics,
            )
        )


def choose_dedup(node: Node, settings: Settings) -> Dedup:
    """Cluster-wide in Redis (one Redis or the node's Redis Cluster); embedded, in memory."""
    if settings.redis_cluster_url is not None:
        from server.bus.redis_cluster_bus import RedisClusterBus

        assert isinstance(node.bus, RedisClusterBus)
        return RedisClusterDedup.on_cluster(node.bus)
    if settings.redis_url is not None:
        from server.redis.client import make_client

        return RedisDedup(make_client(settings.redis_url, retries=1))
    return MemoryDedup()


def choose_lease(node: Node, settings: Settings, key: str) -> Lease:
    """One holder in the cluster (Redis); embedded, the one process always holds it."""
    if not settings.clustered:
        return MemoryLease()
    from server.presence.redis import lease_ms_for

    token = f"{settings.node_id}/{uuid.uuid4().hex}"
    lease_ms = lease_ms_for(settings.node_heartbeat_ms)
    if settings.redis_cluster_url is not None:
        from server.bus.redis_cluster_bus import RedisClusterBus

        assert isinstance(node.bus, RedisClusterBus)
        return RedisLease.on_cluster(node.bus, key, token, lease_ms)
    from server.redis.client import make_client

    assert settings.redis_url is not None
    return RedisLease(make_client(settings.redis_url, retries=1), key, token, lease_ms)
