"""How close can Python get to the C floor? uvloop's ``transport.write`` against ``send()``.

    python -m loadtest.scenarios.write_floor [--rounds 3] [--rate 1500] [--seconds 5]

The fanout scenario reports our node as a share of the C floor
(``loadtest/harness/floor.c``: one ``send()`` per frame). This splits that
share in two. Here a Python process on uvloop, the node's event loop, sends
the same frames to the same number of loopback sockets by the same plan (2,000
sockets watching 10 of 200 games; each event goes to its game's watchers) at
the same rate, with nothing else to do: one ``transport.write`` per frame.
Printed per round, beside the C floor in the same round: frames per CPU-second
of the sender. Python's own write path costs what this is short of 1.0; what
the node is short of this is everything else the node does per event.

The reader (the clients' side) is a forked process draining every socket with
epoll; its CPU, like the clients', is not the sender's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import selectors
import socket
import statistics
import sys
import time
from collections.abc import Sequence

import uvloop

from loadtest.harness.floor import SEND_BUFFER_BYTES, Floor, floor_frame

SOCKETS, GAMES, PER_SOCKET = 2000, 200, 10
SENDER_CPU, READER_CPU = 0, 1


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _drain(fds: Sequence[int]) -> None:
    os.sched_setaffinity(0, {READER_CPU})
    selector = selectors.EpollSelector()
    for fd in fds:
        selector.register(fd, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            try:
                if not os.read(key.fd, 1 << 16):
                    selector.unregister(key.fd)
            except OSError:
                selector.unregister(key.fd)


async def python_floor(
    watchers: Sequence[Sequence[int]], frames: Sequence[bytes], rate: float, seconds: float
) -> float:
    """Frames per CPU-second of one uvloop process writing each frame on its own."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    port = listener.getsockname()[1]
    clients, accepted = [], []
    for _ in range(SOCKETS):
        clients.append(socket.create_connection(("127.0.0.1", port)))
        server_end, _ = listener.accept()
        server_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        accepted.append(server_end)
    listener.close()
    reader = os.fork()
    if reader == 0:  # pragma: no cover - the child only drains
        for end in accepted:
            end.close()
        _drain([client.fileno() for client in clients])
        os._exit(0)
    for client in clients:
        client.close()
    loop = asyncio.get_running_loop()
    transports = []
    for end in accepted:
        end.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, end)
        transports.append(transport)
    writes = [transport.write for transport in transports]
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {SENDER_CPU})
    try:
        await asyncio.sleep(0.5)
        cpu_start, start = _cpu_s(), time.monotonic()
        sent = events = 0
        while (elapsed := time.monotonic() - start) < seconds:
            due = int(elapsed * rate)
            while events < due:
                game = events % len(frames)
                frame = frames[game]
                for watcher in watchers[game]:
                    writes[watcher](frame)
                sent += len(watchers[game])
                events += 1
            await asyncio.sleep(0.001)
        cpu = _cpu_s() - cpu_start
    finally:
        os.sched_setaffinity(0, previous)
        os.kill(reader, 9)
        await asyncio.to_thread(os.waitpid, reader, 0)
        for transport in transports:
            transport.abort()
    return sent / cpu


async def main(rounds: int, rate: float, seconds: float) -> None:
    rng = random.Random(1)
    games = [("chess", f"g{index}") for index in range(GAMES)]
    watching = [rng.sample(range(GAMES), PER_SOCKET) for _ in range(SOCKETS)]
    watchers: list[list[int]] = [[] for _ in games]
    for index, picked in enumerate(watching):
        for game in picked:
            watchers[game].append(index)
    frames = [floor_frame(meta, game_id) for meta, game_id in games]
    floor = Floor(SOCKETS, games, watching, [SENDER_CPU], [READER_CPU])
    ratios = []
    try:
        for number in range(1, rounds + 1):
            c_run = await floor.run(seconds, rate)
            python = await python_floor(watchers, frames, rate, seconds)
            ratios.append(python / c_run.frames_per_cpu_s)
            print(
                f"round {number}: C send() {c_run.frames_per_cpu_s:,.0f} frames/CPU-s, "
                f"Python uvloop write {python:,.0f} frames/CPU-s, "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
    finally:
        floor.close()
    print(f"median ratio, Python write ÷ C send(): {statistics.median(ratios):.3f}")
    print(f"command: python -m loadtest.scenarios.write_floor {' '.join(sys.argv[1:])}".rstrip())


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=1500.0, help="events per second")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    options = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("write_floor needs two CPUs: the sender's and the reader's")
    uvloop.run(main(options.rounds, options.rate, options.seconds))


if __name__ == "__main__":
    cli()
