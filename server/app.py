"""The process: start the node and its listeners, serve until a signal, drain, stop."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import logging
import resource
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from websockets.asyncio.server import Server

from server import __version__, startup_notes
from server.config import Settings
from server.ingress.http import InternalHttp
from server.ingress.websocket import serve_websocket
from server.node import Node
from server.runtime.pauses import PauseWatch
from server.runtime.reclaim import Reclaimer
from server.runtime.tasks import dump_tasks
from server.wiring import build_node

log = logging.getLogger("ap_realtime")

T = TypeVar("T")


async def start_listeners(
    node: Node, reclaimer: Reclaimer | None = None
) -> tuple[Server, InternalHttp]:
    """The public WebSocket listener and the internal HTTP one."""
    ws_server = await serve_websocket(node, reclaimer)
    settings = node.settings
    internal = InternalHttp(node, settings)
    try:
        await internal.start()
    except BaseException:
        ws_server.close()
        raise
    return ws_server, internal


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
    # What a node that will not stop is waiting for: its tasks (USR1), its threads (USR2).
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks, sys.stderr)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    node = await build_node(settings)
    started = await _until_signal(signals, _start(node))
    if started is None:
        log.info("stopped during start-up")  # _start closed what it had opened
        return
    ws_server, internal_http, reclaimer = started
    gc.freeze()  # what start-up allocated lives as long as the process
    pauses = PauseWatch(node.metrics)
    pauses.start()
    mode = (
        "cluster node (Redis Cluster bus)"
        if settings.redis_cluster_url is not None
        else "cluster node (Redis bus)"
        if settings.clustered
        else "embedded (in-process bus)"
    )
    ws_port, http_port = bound_port(ws_server), internal_http.port
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
    await internal_http.stop()


async def _start(node: Node) -> tuple[Server, InternalHttp, Reclaimer]:
    await node.start()
    reclaimer = Reclaimer(node.metrics)
    try:
        ws_server, internal_http = await start_listeners(node, reclaimer)
    except BaseException:
        await node.stop()
        raise
    reclaimer.start()
    return ws_server, internal_http, reclaimer


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
    task.cancel()  # once: a second cancellation would cut short the start's cleanup
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
