"""Read a process's CPU seconds and resident memory from ``/proc``, and raise fd limits.

The same readers serve our server, the baseline, Redis and the generator's own
processes, so every CPU figure in a run is measured the same way: user plus
system time the kernel charged to that process, never wall time. The stand-alone
benchmarks measure this process's own CPU per call with ``cpu_us_per_call``.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK")


def calls_made(calls: int, concurrency: int) -> int:
    """How many of ``calls`` :func:`cpu_us_per_call` makes: as many for every caller."""
    return calls // concurrency * concurrency


async def cpu_us_per_call(
    call: Callable[[int], Awaitable[Any]], calls: int, concurrency: int
) -> float:
    """Microseconds of this process's CPU (user + system) per ``call(i)``, with
    ``concurrency`` callers at once, making :func:`calls_made` calls in all;
    ``i`` numbers the calls of the whole measure."""
    per_task = calls_made(calls, concurrency) // concurrency

    async def caller(index: int) -> None:
        for i in range(per_task):
            await call(index * per_task + i)

    started = time.process_time()
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    return (time.process_time() - started) / (per_task * concurrency) * 1e6


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (``utime + stime`` of ``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        data = stat.read()
    # The command name (field 2) may hold spaces; fields after it are plain.
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def run_delay_seconds(pid: int) -> float:
    """Seconds a process's main thread was runnable but waiting for a CPU.

    The second field of ``/proc/PID/schedstat``. On a shared machine it tells
    how much of a slow wall-clock figure was other processes holding the CPU.
    """
    with open(f"/proc/{pid}/schedstat", "rb") as stat:
        return int(stat.read().split()[1]) / 1e9


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (``VmRSS`` of ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status", "rb") as status:
        for line in status:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}/stat")


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            print(f"loadtest: cannot raise the fd limit: {exc}", file=sys.stderr)
    return soft


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            mem_kib = int(meminfo.readline().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return {
        "cpus": os.cpu_count() or 1,
        "cpu_model": model,
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": os.uname().release,
        "python": sys.version.split()[0],
    }


TCP_COUNTERS = ("ListenOverflows", "ListenDrops", "SyncookiesSent", "TCPReqQFullDrop")


def tcp_counters() -> dict[str, int]:
    """System-wide TCP listen-queue counters (``TcpExt`` of ``/proc/net/netstat``)."""
    try:
        with open("/proc/net/netstat") as netstat:
            lines = netstat.read().splitlines()
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        keys, numbers = names.split(), values.split()
        if keys and keys[0] == "TcpExt:":
            table = dict(zip(keys[1:], numbers[1:], strict=False))
            return {name: int(table.get(name, 0)) for name in TCP_COUNTERS}
    return {}


def somaxconn() -> int:
    try:
        with open("/proc/sys/net/core/somaxconn") as value:
            return int(value.read())
    except (OSError, ValueError):
        return 0
