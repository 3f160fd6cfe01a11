"""The parent's side of the generator: start workers, command them, merge their ticks."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Sequence
from typing import Any

from loadtest.harness.procstat import alive, cpu_seconds
from loadtest.harness.worker import Message, WorkerConfig, worker_main


class WorkerError(RuntimeError):
    """A worker reported a failure or stopped answering."""


class WorkerHandle:
    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Any) -> None:
        self.process = process
        self.conn: multiprocessing.connection.Connection = conn
        self.counters: dict[str, int] = {}
        self.inbox: list[Message] = []
        self.arrived = asyncio.Event()
        self.last_tick = 0.0

    def deliver(self, message: Message) -> None:
        self.inbox.append(message)
        self.arrived.set()

    def take(self, op: str) -> Message | None:
        """The oldest unclaimed answer to ``op`` (or the news that the worker died)."""
        for index, message in enumerate(self.inbox):
            if message["op"] in (op, "dead"):
                return self.inbox.pop(index) if message["op"] == op else message
        return None

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None
        return pid


class WorkerPool:
    """``size`` worker processes, each an event loop full of simulated clients."""

    def __init__(self, size: int, jwt_secret: str, lifetime: float) -> None:
        self.size = size
        self.jwt_secret = jwt_secret
        self.lifetime = lifetime
        self.workers: list[WorkerHandle] = []
        self._context = multiprocessing.get_context("spawn")

    def start(self) -> None:
        for index in range(self.size):
            parent_end, child_end = self._context.Pipe(duplex=True)
            config = WorkerConfig(index=index, jwt_secret=self.jwt_secret, lifetime=self.lifetime)
            process = self._context.Process(
                target=worker_main, args=(config, child_end), name=f"loadtest-worker-{index}"
            )
            process.daemon = True
            process.start()
            child_end.close()
            self.workers.append(WorkerHandle(process, parent_end))

    def attach(self) -> None:
        """Start reading the workers' pipes on the running loop."""
        loop = asyncio.get_running_loop()
        for handle in self.workers:
            loop.add_reader(handle.conn.fileno(), self._readable, handle)
            # uvloop makes a watched fd non-blocking; recv() must block for a whole message
            os.set_blocking(handle.conn.fileno(), True)

    def _readable(self, handle: WorkerHandle) -> None:
        try:
            message: Message = handle.conn.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(handle.conn.fileno())
            handle.deliver({"op": "dead"})
            return
        if message["op"] == "tick":
            handle.counters = message["c"]
            handle.last_tick = time.monotonic()
        else:
            handle.deliver(message)

    async def ready(self, limit: float = 30.0) -> None:
        """Wait until every worker has ticked once (its loop is running)."""
        deadline = time.monotonic() + limit
        while any(h.last_tick == 0.0 for h in self.workers):
            if time.monotonic() > deadline:
                raise WorkerError("workers did not start")
            await asyncio.sleep(0.05)

    def send(self, index: int, message: Message) -> None:
        self.workers[index].conn.send(message)

    async def reply(self, index: int, op: str, limit: float) -> Message:
        handle = self.workers[index]
        deadline = time.monotonic() + limit
        while True:
            message = handle.take(op)
            if message is not None:
                if message["op"] == "dead":
                    raise WorkerError(f"worker {index} exited")
                if "error" in message:
                    raise WorkerError(f"worker {index} failed {op!r}: {message['error']}")
                return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"worker {index} did not answer {op!r} in {limit:.0f} s")
            handle.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.arrived.wait(), remaining)

    async def command(
        self, indexes: Sequence[int], messages: Sequence[Message], limit: float
    ) -> list[Message]:
        """Send one message to each worker in ``indexes`` and wait for every answer."""
        for index, message in zip(indexes, messages, strict=True):
            self.send(index, message)
        return list(
            await asyncio.gather(
                *(
                    self.reply(index, str(message["op"]), limit)
                    for index, message in zip(indexes, messages, strict=True)
                )
            )
        )

    async def broadcast(self, message: Message, limit: float) -> list[Message]:
        indexes = list(range(self.size))
        return await self.command(indexes, [message] * self.size, limit)

    def total(self, name: str) -> int:
        return sum(handle.counters.get(name, 0) for handle in self.workers)

    def totals(self) -> dict[str, int]:
        names: set[str] = set()
        for handle in self.workers:
            names.update(handle.counters)
        return {name: self.total(name) for name in sorted(names)}

    def cpu_seconds(self) -> list[float]:
        """CPU seconds of each worker process so far."""
        values: list[float] = []
        for handle in self.workers:
            try:
                values.append(cpu_seconds(handle.pid))
            except (OSError, ValueError):
                values.append(0.0)
        return values

    async def fresh_ticks(self, limit: float = 2.0) -> None:
        """Wait until every worker has ticked since now, so the totals are current."""
        since = time.monotonic()
        for _ in range(max(1, int(limit / 0.02))):
            if all(h.last_tick >= since for h in self.workers):
                break
            await asyncio.sleep(0.02)

    def stop(self) -> None:
        loop: asyncio.AbstractEventLoop | None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        for handle in self.workers:
            if loop is not None:
                with contextlib.suppress(Exception):
                    loop.remove_reader(handle.conn.fileno())
            with contextlib.suppress(Exception):
                handle.conn.send({"op": "exit"})
        for handle in self.workers:
            handle.process.join(timeout=5)
            if handle.process.is_alive():
                handle.process.terminate()
                handle.process.join(timeout=2)
            if (
                handle.process.is_alive()
                and handle.process.pid is not None
                and alive(handle.process.pid)
            ):
                handle.process.kill()
            with contextlib.suppress(Exception):
                handle.conn.close()
