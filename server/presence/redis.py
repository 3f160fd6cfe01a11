"""Presence across nodes: the :class:`~server.presence.core.PresenceBackend` kept in Redis.

Each node keeps its own users in a hash and proves it is alive with a
heartbeat. One node at a time holds the writer lease; its
:class:`~server.presence.core.PresenceWriter` commits deltas through one Lua
script that checks the lease (fencing), checks that the delta is exactly the
change from the committed state at ``seq - 1``, applies it, sets ``seq`` and
publishes it: commit order is publish order, and a stale writer emits nothing.
The lease holder also withdraws nodes whose heartbeat stopped, and deletes
their ``wsConnections`` rows. ``docs/cluster.md`` explains the design.

Keys (one hash tag, so one Redis Cluster slot)::

    ap:{presence}:nodes        zset  node id -> last heartbeat (Redis time, ms)
    ap:{presence}:node:<id>    hash  user -> "1" visible | "0" invisible
    ap:{presence}:dead:<id>    str   tombstone: <id> was presumed dead (ttl 1 h)
    ap:{presence}:purge        set   dead nodes whose rows are still to delete
    ap:{presence}:leader       str   lease holder's token, PX lease
    ap:{presence}:seq          str   committed seq
    ap:{presence}:committed    hash  user -> "1" | "0", the committed state
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from redis.exceptions import RedisError

from protocol.envelope import PresenceHint, encode_envelope
from protocol.messages import PresenceDelta
from server.bus.topics import PRESENCE, PRESENCE_HINTS
from server.config import Settings
from server.coordination.lease import LeaseState, RedisLease, new_token
from server.presence import scripts as cluster_lua
from server.presence.core import Changes, CommittedPresence, Member, UserStates, apply_changes
from server.redis.client import RedisUnavailable
from server.redis.keys import PRESENCE_NAMESPACE, channel_for
from server.redis.scripts import ShardScript, for_bus
from server.runtime.backoff import Backoff
from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_all_and_wait
from server.store.base import Store

log = logging.getLogger(__name__)


WRITER_RENEW_SECONDS = 1.0
"""How often the presence writer renews its lease (PresenceWriter's default)."""
TOMBSTONE_MS = 3_600_000
START_TIMEOUT = 30.0
START_BACKOFF = Backoff(first=1.0, cap=1.0, jitter=0.0)
"""Registering at start-up is tried once a second until ``START_TIMEOUT``."""

ALIVE, UNKNOWN, PRESUMED_DEAD = 0, 1, 2


class SharedBus(Protocol):
    """What cluster presence needs from a Redis-backed bus (one Redis or a cluster)."""

    url: str
    sharded: bool
    """True on a Redis Cluster: scripts publish with SPUBLISH."""

    @property
    def connected(self) -> bool: ...

    @property
    def connected_since(self) -> float: ...

    def on_reconnect(self, callback: Callable[[], None]) -> None: ...

    def command_client(self) -> Any:
        """A new command client (``redis.asyncio.Redis`` or ``RedisCluster``)."""


def lease_ms_for(heartbeat_ms: int) -> int:
    """The writer lease: three renewals or three heartbeats, whichever is longer."""
    return max(3 * int(WRITER_RENEW_SECONDS * 1000), 3 * heartbeat_ms)


def _state(value: bool | None) -> str:
    return "" if value is None else ("1" if value else "0")


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _decode_states(flat: list[bytes]) -> UserStates:
    return {flat[i].decode(): flat[i + 1] == b"1" for i in range(0, len(flat), 2)}


class RedisPresenceBackend:
    """This node's side of cluster presence: report, heartbeat, lease, commit, sweep."""

    def __init__(
        self,
        bus: SharedBus,
        store: Store,
        *,
        node_id: str,
        heartbeat_ms: int = 2000,
        timeout_ms: int = 10_000,
        lease_ms: int | None = None,
        metrics: Registry | None = None,
    ) -> None:
        registry = metrics or Registry()
        self._nodes_swept = registry.counter(
            "ap_cluster_nodes_presumed_dead_total",
            "Nodes withdrawn because their heartbeat stopped",
        )
        self._commits_refused = registry.counter(
            "ap_presence_commits_refused_total", "Presence commits refused as fenced or stale"
        )
        self._bus = bus
        self._store = store
        self._node_id = node_id
        self._heartbeat = heartbeat_ms / 1000
        self._timeout_ms = timeout_ms
        self._lease_ms = lease_ms if lease_ms is not None else lease_ms_for(heartbeat_ms)
        # A client of its own: presence keeps working while the bus closes, and
        # a burst of game events never queues in front of a heartbeat.
        self._client = bus.command_client()
        self._leading = False
        self._mine: UserStates = {}  # what this node has reported, to re-register
        self._write_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._purge_task: asyncio.Task[None] | None = None
        self._presumed_dead: list[Callable[[], None]] = []
        ns = PRESENCE_NAMESPACE
        self._nodes = ns + "nodes"
        self._node_key = ns + "node:" + node_id
        self._tombstone = ns + "dead:" + node_id
        self._purge_key = ns + "purge"
        self._seq = ns + "seq"
        self._committed = ns + "committed"
        self._hints = channel_for(PRESENCE_HINTS)
        self._deltas = channel_for(PRESENCE)

        def script(source: str) -> Any:
            source = for_bus(source, sharded=bus.sharded)
            if bus.sharded:
                return ShardScript(self._client, source)
            return self._client.register_script(source)

        self._report_script = script(cluster_lua.REPORT)
        self._register_script = script(cluster_lua.REGISTER)
        self._heartbeat_script = script(cluster_lua.HEARTBEAT)
        self._deregister_script = script(cluster_lua.DEREGISTER)
        self._sweep_script = script(cluster_lua.SWEEP)
        self._online_script = script(cluster_lua.ONLINE)
        self._read_script = script(cluster_lua.READ_COMMITTED)
        self._init_script = script(cluster_lua.INIT_COMMITTED)
        self._commit_script = script(cluster_lua.COMMIT)
        # The writer lease; COMMIT checks its token in the same step (fencing).
        self._lease = RedisLease(
            self._client, ns + "leader", new_token(node_id), self._lease_ms, owns_client=False
        )
        bus.on_reconnect(self._wake.set)

    @classmethod
    def from_settings(
        cls, settings: Settings, bus: SharedBus, store: Store, metrics: Registry | None = None
    ) -> RedisPresenceBackend:
        return cls(
            bus,
            store,
            node_id=settings.node_id,
            heartbeat_ms=settings.node_heartbeat_ms,
            timeout_ms=settings.node_timeout_ms,
            metrics=metrics,
        )

    def on_presumed_dead(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when this node learns the cluster withdrew it while it lived."""
        self._presumed_dead.append(callback)

    @property
    def leading(self) -> bool:
        return self._leading

    # --- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Register this node (dropping what an earlier run left) and start heartbeating."""
        retrying = START_BACKOFF.start(deadline=time.monotonic() + START_TIMEOUT)
        while True:
            try:
                await self._register()
                break
            except (RedisError, OSError) as exc:
                delay = retrying.next_delay()
                if delay is None:
                    raise RedisUnavailable(
                        f"Redis at {self._bus.url} is unreachable: {exc}"
                    ) from exc
                log.warning("waiting for Redis at %s: %s", self._bus.url, exc)
                await asyncio.sleep(delay)
        self._task = asyncio.create_task(self._maintain(), name="cluster-heartbeat")

    async def close(self) -> None:
        """Leave the cluster: give up the lease and withdraw this node's users at once."""
        joined = self._task is not None
        await cancel_all_and_wait((self._task, self._purge_task))
        if joined:  # else start-up failed or was cancelled: there is nothing to leave
            try:
                async with asyncio.timeout(3):
                    await self._lease.release()
                    await self._deregister_script(
                        keys=[self._nodes, self._node_key], args=[self._node_id, self._hints]
                    )
            except (RedisError, OSError) as exc:
                log.warning("could not leave the cluster cleanly (peers will time us out): %s", exc)
        self._leading = False
        with contextlib.suppress(Exception):
            await self._client.aclose()

    # --- PresenceBackend ----------------------------------------------------

    async def report(self, changes: Changes, changed_at: float) -> None:
        async with self._write_lock:
            apply_changes(self._mine, changes)
            hint = PresenceHint(
                node_id=self._node_id, user_ids=tuple(changes), changed_at=changed_at
            )
            args: list[Any] = [self._hints, encode_envelope(hint)]
            for user, state in changes.items():
                args += [user, _state(state)]
            await self._report_script(keys=[self._node_key], args=args)

    async def online(self, user_ids: Collection[str] | None) -> UserStates:
        if user_ids is not None and not user_ids:
            return {}
        args: list[Any] = [PRESENCE_NAMESPACE]
        args += ["all"] if user_ids is None else ["some", *user_ids]
        flat = await self._online_script(keys=[self._nodes], args=args)
        return _decode_states(flat)

    async def committed(self) -> CommittedPresence:
        keys = [self._seq, self._committed]
        raw = await self._read_script(keys=keys)
        if raw is None:
            start = await self._store.current_presence_seq()
            if await self._init_script(keys=keys, args=[start]):
                log.info("presence state initialised in Redis at seq %d (from wsMeta)", start)
            raw = await self._read_script(keys=keys)
            if raw is None:
                raise RuntimeError("the committed presence state vanished while it was read")
        seq, flat = raw
        return CommittedPresence(seq=int(seq), users=_decode_states(flat))

    async def committed_seq(self) -> int | None:
        raw = await self._client.get(self._seq)
        return None if raw is None else int(raw)

    async def commit(self, delta: PresenceDelta, changes: Changes) -> bool:
        leaves = set(delta.leaves)
        args: list[Any] = [
            self._lease.token,
            delta.seq,
            delta.total_count,
            self._deltas,
            encode_envelope(delta),
        ]
        for user, state in changes.items():
            args += [user, _state(state), "1" if user in leaves else "0"]
        result = await self._commit_script(
            keys=[self._lease.key, self._seq, self._committed], args=args
        )
        if result == 1:
            return True
        self._commits_refused.inc()
        if result == 0:
            self._leading = False
            log.warning("presence commit at seq %d fenced: this node no longer leads", delta.seq)
        else:
            log.warning("presence commit at seq %d refused as stale: reloading", delta.seq)
        return False

    async def lead(self) -> bool:
        try:
            state = await self._lease.renew()
        except BaseException:
            self._leading = False
            raise
        if state is LeaseState.ACQUIRED and self._leading:
            # The lease lapsed while held (a Redis restart, a long pause): give
            # the role up for one round so the writer reloads the committed state.
            log.warning("presence lease lapsed while held; reloading before writing again")
            self._leading = False
            return False
        self._leading = state is not LeaseState.LOST
        return self._leading

    async def members(self) -> list[Member]:
        now_s, now_us = await self._client.time()
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        beats: list[tuple[bytes, float]] = await self._client.zrange(
            self._nodes, 0, -1, withscores=True
        )
        leader = await self._client.get(self._lease.key)
        writer = _text(leader).split("/", 1)[0] if leader is not None else None
        pipe = self._client.pipeline(transaction=False)
        for raw, _ in beats:
            pipe.hlen(PRESENCE_NAMESPACE + "node:" + _text(raw))
        sizes = await pipe.execute()
        return [
            Member(_text(raw), max(0, now_ms - int(beat)), int(size), _text(raw) == writer)
            for (raw, beat), size in zip(beats, sizes, strict=True)
        ]

    # --- membership ---------------------------------------------------------

    async def _register(self) -> None:
        async with self._write_lock:
            args: list[Any] = [self._node_id, self._hints]
            for user, state in self._mine.items():
                args += [user, _state(state)]
            await self._register_script(
                keys=[self._nodes, self._node_key, self._tombstone, self._purge_key], args=args
            )
        log.info("joined the cluster as %s with %d users", self._node_id, len(self._mine))

    async def _maintain(self) -> None:
        """Heartbeat; re-register after a reconnect; sweep dead nodes while leading."""
        failing = False
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._heartbeat)
            reconnected = self._wake.is_set()
            self._wake.clear()
            try:
                if reconnected:
                    await self._register()
                else:
                    status = await self._heartbeat_script(
                        keys=[self._nodes, self._tombstone], args=[self._node_id]
                    )
                    if status != ALIVE:
                        presumed_dead = status == PRESUMED_DEAD
                        log.warning(
                            "this node was %s; registering again",
                            "presumed dead by the cluster" if presumed_dead else "unknown to Redis",
                        )
                        await self._register()
                        if presumed_dead:
                            for callback in self._presumed_dead:
                                callback()
                if self._may_sweep():
                    await self._sweep()
                if failing:
                    log.info("cluster heartbeat restored")
                    failing = False
            except Exception as exc:  # this loop must outlive any failure
                if not failing:
                    log.warning("cluster heartbeat failed: %s", exc)
                    failing = True

    def _may_sweep(self) -> bool:
        now = time.monotonic()
        return (
            self._leading
            and now < self._lease.valid_until
            and self._bus.connected
            # After an outage every heartbeat is old: give all nodes time to return.
            and now - self._bus.connected_since >= self._timeout_ms / 1000
        )

    async def _sweep(self) -> None:
        swept = await self._sweep_script(
            keys=[self._nodes, self._purge_key],
            args=[PRESENCE_NAMESPACE, self._timeout_ms, TOMBSTONE_MS, self._hints, self._node_id],
        )
        for node_id in swept:
            self._nodes_swept.inc()
            log.warning(
                "node %s missed heartbeats for %d ms: its users are withdrawn",
                node_id.decode(),
                self._timeout_ms,
            )
        if self._purge_task is None or self._purge_task.done():
            self._purge_task = asyncio.create_task(self._purge(), name="cluster-purge")

    async def _purge(self) -> None:
        """Delete the ``wsConnections`` rows of dead nodes; retried until done."""
        try:
            dead: set[bytes | str] = await self._client.smembers(self._purge_key)
            for raw in dead:
                node_id = raw.decode() if isinstance(raw, bytes) else raw
                if await self._client.zscore(self._nodes, node_id) is None:
                    count = await self._store.delete_endpoint_connections(node_id)
                    log.info("deleted %d connection rows of dead node %s", count, node_id)
                await self._client.srem(self._purge_key, node_id)
        except Exception as exc:
            log.warning("deleting dead nodes' rows failed, will retry: %s", exc)
