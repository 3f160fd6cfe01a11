"""Wire the parts together from settings and run the listeners."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
import uuid
from collections.abc import Coroutine, Sequence
from http import HTTPStatus
from typing import Any, TypeVar

from aiohttp import web
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from protocol.errors import (
    MAX_FRAME_BYTES,
    MSGPACK_SUBPROTOCOL,
    CloseCode,
    ErrorCode,
    ProtocolError,
)
from protocol.messages import Chat, Subscribe, SyncPresence, WatchGames
from protocol.parse import parse_client_frame
from server import __version__, startup_notes
from server.auth.jwks import jwks_source
from server.auth.verify import Authenticator, BotVerifier, CognitoVerifier, DevVerifier
from server.bus.base import Bus
from server.bus.memory import MemoryBus
from server.bus.streams import MemoryStreams
from server.config import Settings
from server.coordination.dedup import Dedup, MemoryDedup, RedisClusterDedup, RedisDedup
from server.coordination.lease import Lease, MemoryLease, RedisLease
from server.ingress.http import build_app
from server.node import Coordination, Node
from server.presence.core import MemoryPresenceBackend, PresenceBackend
from server.runtime import logs
from server.runtime.metrics import REGISTRY
from server.runtime.pauses import PauseWatch
from server.runtime.reclaim import Reclaimer
from server.runtime.token_bucket import TokenBucket
from server.session import GuardedConnection, Session
from server.store.base import Store
from server.store.memory import MemoryStore

log = logging.getLogger("ap_realtime")

T = TypeVar("T")

bad_frames = REGISTRY.counter("ap_client_errors_total", "Client frames answered with an error")


def build_authenticator(settings: Settings) -> Authenticator:
    cognito = None
    if settings.cognito_issuer is not None and settings.cognito_client_id is not None:
        cognito = CognitoVerifier(
            settings.cognito_issuer,
            settings.cognito_client_id,
            jwks_source(settings.cognito_issuer, settings.jwks_file),
        )
    bot = None
    if settings.bot_cognito_issuer is not None and settings.bot_scope is not None:
        bot = BotVerifier(
            settings.bot_cognito_issuer,
            settings.bot_scope,
            jwks_source(settings.bot_cognito_issuer, settings.bot_jwks_file),
        )
    dev = DevVerifier(settings.dev_jwt_secret) if settings.dev_jwt_secret else None
    return Authenticator(cognito=cognito, dev=dev, bot=bot, cache_size=settings.token_cache_size)


def build_store(settings: Settings) -> Store:
    if settings.store == "dynamodb":
        from server.store.dynamodb import DynamoStore

        return DynamoStore(
            table=settings.table, region=settings.region, endpoint_url=settings.dynamodb_endpoint
        )
    return MemoryStore()


async def build_node(settings: Settings, store: Store | None = None) -> Node:
    """A node ready to ``start()``: memory parts by default, shared ones when configured."""
    if store is None:
        store = build_store(settings)
    bus: Bus
    backend: PresenceBackend
    if settings.clustered:
        from server.bus.redis_bus import RedisBus
        from server.bus.redis_cluster_bus import RedisClusterBus
        from server.bus.redis_streams import RedisStreams
        from server.presence.redis import RedisPresenceBackend

        redis_bus: RedisBus | RedisClusterBus
        if settings.redis_cluster_url is not None:
            redis_bus = RedisClusterBus(settings.redis_cluster_url, name=settings.node_id)
            streams = RedisStreams.on_cluster(redis_bus, settings.stream_limits)
        else:
            assert settings.redis_url is not None
            redis_bus = RedisBus(settings.redis_url, name=settings.node_id)
            streams = RedisStreams(settings.redis_url, settings.stream_limits)
        cluster = RedisPresenceBackend.from_settings(settings, redis_bus, store)
        node = Node(
            settings,
            store,
            redis_bus,
            cluster,
            build_authenticator(settings),
            streams,
            redis_coordination(settings),
        )
        # After a Redis reconnect the node reloads presence and re-snapshots its
        # clients; if the cluster presumed it dead, it writes its rows again.
        redis_bus.on_reconnect(node.resync)
        # Events published meanwhile are in the streams' history: fill the holes.
        redis_bus.on_reconnect(node.check_streams)
        cluster.on_presumed_dead(node.rewrite_rows)
    else:
        memory_bus = MemoryBus()
        bus = memory_bus
        backend = MemoryPresenceBackend(memory_bus, store, settings.node_id)
        memory_streams = MemoryStreams(memory_bus, settings.stream_limits)
        REGISTRY.gauge(
            "ap_stream_history_bytes",
            "Event bytes kept in the streams' histories (embedded: in this process)",
            memory_streams.history_bytes,
        )
        node = Node(settings, store, bus, backend, build_authenticator(settings), memory_streams)
    add_bridges(node, settings)
    return node


def _dedup(node: Node, settings: Settings) -> Dedup:
    """Cluster-wide in Redis (one Redis or the node's Redis Cluster); embedded, in memory."""
    if settings.redis_cluster_url is not None:
        from server.bus.redis_cluster_bus import RedisClusterBus

        assert isinstance(node.bus, RedisClusterBus)
        return RedisClusterDedup.on_cluster(node.bus)
    if settings.redis_url is not None:
        from server.bus.redis_bus import make_client

        return RedisDedup(make_client(settings.redis_url, retries=1))
    return MemoryDedup()


def add_bridges(node: Node, settings: Settings) -> None:
    """The AWS inputs, each only when its flag is set: nothing polls AWS otherwise."""
    if settings.sqs_queue_url is not None:
        from server.ingress.sqs import SqsBridge

        node.services.append(
            SqsBridge(
                node,
                _dedup(node, settings),
                settings.sqs_queue_url,
                region=settings.region,
                endpoint_url=settings.sqs_endpoint,
                pollers=settings.sqs_pollers,
                wait_seconds=settings.sqs_wait_seconds,
                visibility_seconds=settings.sqs_visibility_seconds,
            )
        )
    if settings.notifications_from_stream:
        from server.ingress.notifications import NotificationPush

        node.services.append(
            NotificationPush(
                node,
                node.store,
                _lease(node, settings, "ap:{notifications}:leader"),
                _dedup(node, settings),
                table=settings.table,
                region=settings.region,
                endpoint_url=settings.dynamodb_endpoint,
                poll_seconds=settings.stream_poll_ms / 1000,
            )
        )


def _lease(node: Node, settings: Settings, key: str) -> Lease:
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
    from server.bus.redis_bus import make_client

    assert settings.redis_url is not None
    return RedisLease(make_client(settings.redis_url, retries=1), key, token, lease_ms)


def redis_coordination(settings: Settings) -> Coordination:
    """The services' cluster-wide parts: per-game chat locks, the chat rate, lastSeen claims.

    Their keys carry the hash tag of a game or a user, one key per script, so
    they work unchanged on a Redis Cluster.
    """
    from server.coordination.claims import RedisClaims
    from server.coordination.game_lock import RedisGameLocks
    from server.coordination.rate_limit import RedisRateLimiter
    from server.services.chat import RATE_WINDOW_SECONDS

    sharded = settings.redis_cluster_url is not None
    url = settings.redis_cluster_url if sharded else settings.redis_url
    assert url is not None
    return Coordination(
        RedisGameLocks(url, cluster=sharded),
        RedisRateLimiter(url, "chat", settings.chat_rate, RATE_WINDOW_SECONDS, cluster=sharded),
        RedisClaims(url, "last-seen", cluster=sharded),
    )


def _select_subprotocol(
    connection: ServerConnection, offered: Sequence[Subprotocol]
) -> Subprotocol | None:
    # Browsers offer none and get JSON; clients that ask for msgpack get it.
    return Subprotocol(MSGPACK_SUBPROTOCOL) if MSGPACK_SUBPROTOCOL in offered else None


class Handler:
    """Runs one socket's session: read frames in order, act, answer."""

    def __init__(self, node: Node, reclaimer: Reclaimer | None = None) -> None:
        self.node = node
        self.reclaimer = reclaimer
        settings = node.settings
        self.limit = settings.outbox_limit_bytes
        self.credits = settings.flood_credits
        self.refill = settings.flood_credits / settings.flood_window_seconds
        self.subscribe_timeout = settings.subscribe_timeout

    async def __call__(self, ws: ServerConnection) -> None:
        # The library's subprotocol callback closes over the connection, which
        # holds the protocol that holds the callback: a cycle that outlives the
        # socket until a full collection. The handshake is over; drop it.
        vars(ws.protocol).pop("select_subprotocol", None)
        loop = asyncio.get_running_loop()
        session = Session(ws, TokenBucket(self.credits, self.refill, loop.time()))
        logs.connection_id.set(session.connection_id)  # this task serves only this socket
        if isinstance(ws, GuardedConnection):
            ws.session = session
        if self.subscribe_timeout > 0:
            session.deadline = loop.call_later(self.subscribe_timeout, self._deadline, session)
        self.node.opened(session)
        try:
            async for data in ws:
                if session.close_task is None:  # a flooder's backlog is not worth handling
                    await self.receive(session, data)
                # Frames already buffered come without a pause: let other sockets
                # and the fan-out run between two of this one's frames.
                await asyncio.sleep(0)
        except ConnectionClosed:
            pass
        finally:
            if session.deadline is not None:
                session.deadline.cancel()
            self.node.closed(session)
            if isinstance(ws, GuardedConnection):
                ws.session = None  # no cycle between a closed socket and its session
            if self.reclaimer is not None:
                self.reclaimer.closed()

    @staticmethod
    def _deadline(session: Session) -> None:
        session.deadline = None
        if not session.subscribed:
            session.close(CloseCode.SUBSCRIBE_DEADLINE, "no subscribe in time")

    async def receive(self, session: Session, data: str | bytes) -> None:
        try:
            action = parse_client_frame(data)
        except ProtocolError as exc:
            bad_frames.inc()
            session.send_error(exc.code, exc.message, self.limit, exc.client_msg_id)
            if exc.code is ErrorCode.UNAUTHORIZED:
                # subscribe without a usable token: refused like a bad one
                session.close(CloseCode.POLICY_VIOLATION, "invalid token")
            return
        if isinstance(action, Subscribe):
            await self.node.subscribe(session, action)
        elif not session.subscribed:
            bad_frames.inc()
            session.send_error(ErrorCode.NOT_SUBSCRIBED, "Not subscribed", self.limit)
        elif isinstance(action, WatchGames):
            await self.node.watch(session, action.games, action.since)
        elif isinstance(action, SyncPresence):
            self.node.sync_presence(session)
        elif isinstance(action, Chat):
            await self.node.chat.post(session, action)


refused_upgrades = REGISTRY.counter(
    "ap_refused_upgrades_total", "WebSocket upgrades answered 503 (node cap or accept rate)"
)


class Admission:
    """Refuses upgrades with 503 before any WebSocket state exists: over the
    node's connection cap, or faster than the accept rate (with Retry-After)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        settings = node.settings
        self.max_connections = settings.max_connections
        self.bucket: TokenBucket | None = None
        if settings.accept_rate > 0:
            rate = settings.accept_rate
            self.bucket = TokenBucket(rate, rate, asyncio.get_running_loop().time())

    def check(self, connection: ServerConnection, request: Request) -> Response | None:
        if self.max_connections and len(self.node.sessions) >= self.max_connections:
            refused_upgrades.inc()
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "node is full\n")
        bucket = self.bucket
        if bucket is not None:
            now = asyncio.get_running_loop().time()
            if not bucket.take(now):
                refused_upgrades.inc()
                response = connection.respond(
                    HTTPStatus.SERVICE_UNAVAILABLE, "too many new connections\n"
                )
                response.headers["Retry-After"] = str(bucket.retry_after(now))
                return response
        return None


async def start_listeners(
    node: Node, reclaimer: Reclaimer | None = None
) -> tuple[Server, web.AppRunner]:
    settings = node.settings
    guarded = type(
        "NodeConnection",
        (GuardedConnection,),
        {
            "outbox_limit": settings.outbox_limit_bytes,
            "send_buffer_bytes": settings.socket_send_buffer_bytes,
        },
    )
    ws_server = await serve(
        Handler(node, reclaimer),
        settings.host,
        settings.port,
        select_subprotocol=_select_subprotocol,
        compression=None,  # frames are tiny; deflate would cost ~50 KiB per socket
        max_size=MAX_FRAME_BYTES,
        ping_interval=settings.ping_interval,
        ping_timeout=settings.ping_timeout,
        close_timeout=settings.close_timeout,
        backlog=settings.listen_backlog,
        create_connection=guarded,
        process_request=Admission(node).check,
    )
    runner = web.AppRunner(build_app(node), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.http_host, settings.http_port, backlog=1024)
    await site.start()
    return ws_server, runner


def bound_port(server: Server) -> int:
    port: int = server.sockets[0].getsockname()[1]
    return port


def tune_process() -> None:
    """Settings of the process, not of the node: file descriptors and the collector."""
    # Each socket is a file descriptor; 10,000 clients need more than the usual
    # soft limit of 1024, and the hard limit is ours to take.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # Connections are long-lived objects by the ten thousand: with the default
    # thresholds, full collections walk all of them again and again during a
    # connect storm (measured: 25-320 ms pauses) and free nothing. Collect the
    # young generation less often and the old one far less often.
    gc.set_threshold(50_000, 20, 100)


async def serve_forever(settings: Settings) -> None:
    """Run until SIGINT or SIGTERM, then drain. Signals are honoured during start-up too."""
    tune_process()
    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, signals.put_nowait, signum)
    node = await build_node(settings)
    started = await _until_signal(signals, _start(node))
    if started is None:
        log.info("stopped during start-up")  # _start closed what it had opened
        return
    ws_server, runner, reclaimer = started
    gc.freeze()  # what start-up allocated lives as long as the process
    pauses = PauseWatch()
    pauses.start()
    mode = (
        "cluster node (Redis Cluster bus)"
        if settings.redis_cluster_url is not None
        else "cluster node (Redis bus)"
        if settings.clustered
        else "embedded (in-process bus)"
    )
    ws_port, http_port = bound_port(ws_server), runner.addresses[0][1]
    log.info(
        "ap-realtime %s %s: ws://%s:%d, internal http://%s:%d, node %s, %s store; %s",
        __version__,
        mode,
        settings.host,
        ws_port,
        settings.http_host,
        http_port,
        settings.node_id,
        settings.store,
        startup_notes.summary(settings),
    )
    if not node.authenticator.enabled:
        log.warning(startup_notes.NO_VERIFIER)
    if settings.dev:
        print(startup_notes.dev_banner(settings, ws_port, http_port), flush=True)
    await signals.get()
    # Stop accepting at once; /readyz is 503 from here. A second signal cuts the drain short.
    ws_server.close(close_connections=False)
    log.info("draining over %gs (a second signal stops at once)", settings.drain_seconds)
    if await _until_signal(signals, node.drain(settings.drain_seconds)) is None:
        log.info("second signal: closing the remaining sessions at once")
    log.info("shutting down: deleting this node's rows and leaving presence")
    await reclaimer.stop()
    await pauses.stop()
    await node.stop()
    with contextlib.suppress(Exception):
        await ws_server.wait_closed()
    await runner.cleanup()


async def _start(node: Node) -> tuple[Server, web.AppRunner, Reclaimer]:
    await node.start()
    reclaimer = Reclaimer()
    try:
        ws_server, runner = await start_listeners(node, reclaimer)
    except BaseException:
        await node.stop()
        raise
    reclaimer.start()
    return ws_server, runner, reclaimer


async def _until_signal(signals: asyncio.Queue[int], work: Coroutine[Any, Any, T]) -> T | None:
    """Run ``work`` to its end, or cancel it (and return None) when a signal arrives."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(signals.get())
    try:
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        if waiter.done() and not waiter.cancelled():
            signals.put_nowait(waiter.result())  # both at once: the signal still counts
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
