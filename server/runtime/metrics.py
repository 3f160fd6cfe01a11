"""Counters and gauges, rendered in the Prometheus text format.

Each node owns a :class:`Registry` (made where the node is wired, ``server/app.py``);
every component that counts something is given it, or a bundle of its counters,
when it is built, and registers its metrics then, so ``/metrics`` shows every one
of them even before it first moves. Two nodes in one process (the tests run
several) therefore never share, or overwrite, each other's counters and gauges.

Hand-written rather than ``prometheus-client``: counters here are bumped on the
fan-out path once per batch of frames, and a plain float add is several times
cheaper than that library's locked increment; what a scrape needs (HELP, TYPE,
the exposition content type) is a few lines.
"""

from __future__ import annotations

from collections.abc import Callable


class Counter:
    """A monotonically increasing count."""

    __slots__ = ("help", "name", "value")

    def __init__(self, name: str, help: str) -> None:
        self.name = name
        self.help = help
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Gauge:
    """A value read when scraped."""

    __slots__ = ("help", "name", "read")

    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        self.name = name
        self.help = help
        self.read = read


class CounterFunc(Gauge):
    """A count kept elsewhere (the kernel's CPU time), read when scraped."""

    __slots__ = ()


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format, as scrapers expect it named."""


class Registry:
    def __init__(self) -> None:
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, Gauge] = {}

    def counter(self, name: str, help: str) -> Counter:
        """Get or create a counter; the same name always gives the same counter."""
        counter = self._counters.get(name)
        if counter is None:
            counter = self._counters[name] = Counter(name, help)
        return counter

    def gauge(self, name: str, help: str, read: Callable[[], float]) -> Gauge:
        """Register (or replace) a gauge read at scrape time."""
        gauge = self._gauges[name] = Gauge(name, help, read)
        return gauge

    def counter_func(self, name: str, help: str, read: Callable[[], float]) -> CounterFunc:
        """Register (or replace) a counter whose value is read at scrape time."""
        counter = CounterFunc(name, help, read)
        self._gauges[name] = counter
        return counter

    def value(self, name: str) -> float:
        if name in self._counters:
            return self._counters[name].value
        return self._gauges[name].read()

    def get(self, name: str) -> float | None:
        """The metric's value, or None if nothing registered it (an optional feature)."""
        if name in self._counters or name in self._gauges:
            return self.value(name)
        return None

    def render(self) -> str:
        lines: list[str] = []
        for counter in self._counters.values():
            lines += [
                f"# HELP {counter.name} {counter.help}",
                f"# TYPE {counter.name} counter",
                f"{counter.name} {_number(counter.value)}",
            ]
        for gauge in self._gauges.values():
            lines += [
                f"# HELP {gauge.name} {gauge.help}",
                f"# TYPE {gauge.name} {'counter' if isinstance(gauge, CounterFunc) else 'gauge'}",
                f"{gauge.name} {_number(gauge.read())}",
            ]
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _process_cpu_seconds() -> float:
    import os

    times = os.times()
    return times.user + times.system


def _process_rss_bytes() -> float:
    # /proc is Linux-only; elsewhere the gauge reads 0 rather than failing a scrape.
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except OSError:
        return 0.0
    import resource

    return float(pages * resource.getpagesize())


def register_process(registry: Registry) -> None:
    """The process's own readings (CPU time, resident memory) on a node's registry."""
    registry.counter_func(
        "process_cpu_seconds_total", "User and system CPU seconds", _process_cpu_seconds
    )
    registry.gauge("process_resident_memory_bytes", "Resident set size", _process_rss_bytes)
