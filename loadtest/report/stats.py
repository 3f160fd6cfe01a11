"""Mergeable latency histograms and the summaries printed from them.

A :class:`Histogram` counts integer microseconds in log-linear buckets: exact
below 64 µs, then 32 buckets per power of two (at most 1.6 % error). Worker
processes fill one each and ship its sparse counts to the parent, which merges
them; nothing keeps individual samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_EXACT = 64
_SUB_BITS = 5
_SUB = 1 << _SUB_BITS  # 32 buckets per power of two


def bucket_of(value: int) -> int:
    """The bucket index of a non-negative integer."""
    if value < _EXACT:
        return value if value > 0 else 0
    shift = value.bit_length() - (_SUB_BITS + 1)
    return _EXACT + (shift - 1) * _SUB + ((value >> shift) - _SUB)


def bucket_bounds(index: int) -> tuple[float, float]:
    """The half-open value range ``[low, high)`` a bucket counts."""
    if index < _EXACT:
        return float(index), float(index + 1)
    shift = (index - _EXACT) // _SUB + 1
    mantissa = (index - _EXACT) % _SUB + _SUB
    return float(mantissa << shift), float((mantissa + 1) << shift)


class Histogram:
    """Counts of integer values (microseconds) in log-linear buckets."""

    __slots__ = ("count", "counts", "maximum", "minimum", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.total = 0
        self.minimum = 0
        self.maximum = 0

    def record(self, value: int) -> None:
        if value < _EXACT:
            index = value if value > 0 else 0
            if value < 0:
                value = 0
        else:
            shift = value.bit_length() - (_SUB_BITS + 1)
            index = _EXACT + (shift - 1) * _SUB + ((value >> shift) - _SUB)
        counts = self.counts
        counts[index] = counts.get(index, 0) + 1
        if self.count == 0 or value < self.minimum:
            self.minimum = value
        if value > self.maximum:
            self.maximum = value
        self.count += 1
        self.total += value

    def record_many(self, values: Iterable[int]) -> None:
        for value in values:
            self.record(value)

    def merge(self, other: Histogram) -> None:
        if other.count == 0:
            return
        for index, count in other.counts.items():
            self.counts[index] = self.counts.get(index, 0) + count
        self.minimum = other.minimum if self.count == 0 else min(self.minimum, other.minimum)
        self.maximum = max(self.maximum, other.maximum)
        self.count += other.count
        self.total += other.total

    def percentile(self, fraction: float) -> float:
        """The value below which ``fraction`` of the counts fall (bucket midpoint)."""
        if self.count == 0:
            return math.nan
        rank = max(1, math.ceil(fraction * self.count))
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                low, high = bucket_bounds(index)
                value = low if index < _EXACT else (low + high) / 2
                return float(min(max(value, self.minimum), self.maximum))
        return float(self.maximum)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def cdf(self) -> list[tuple[float, float]]:
        """``(upper bound, cumulative fraction)`` per non-empty bucket, for plots."""
        points: list[tuple[float, float]] = []
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            points.append((bucket_bounds(index)[1], seen / self.count))
        return points

    def to_wire(self) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "count": self.count,
            "total": self.total,
            "min": self.minimum,
            "max": self.maximum,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Histogram:
        histogram = cls()
        histogram.counts = {int(k): int(v) for k, v in data["counts"].items()}
        histogram.count = int(data["count"])
        histogram.total = int(data["total"])
        histogram.minimum = int(data["min"])
        histogram.maximum = int(data["max"])
        return histogram

    def summary_ms(self) -> dict[str, float | int]:
        """Count, mean and percentiles in milliseconds (the values are microseconds)."""
        return {
            "count": self.count,
            "mean_ms": _ms(self.mean),
            "p50_ms": _ms(self.percentile(0.50)),
            "p90_ms": _ms(self.percentile(0.90)),
            "p99_ms": _ms(self.percentile(0.99)),
            "p999_ms": _ms(self.percentile(0.999)),
            "max_ms": _ms(float(self.maximum) if self.count else math.nan),
        }


def _ms(microseconds: float) -> float:
    return round(microseconds / 1000, 3) if not math.isnan(microseconds) else math.nan


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of a list (sorted or not); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ratio(ours: float, theirs: float) -> float:
    """``ours / theirs``, NaN when either is missing or the divisor is zero."""
    if theirs == 0 or math.isnan(theirs) or math.isnan(ours):
        return math.nan
    return ours / theirs


def mean_of(values: Sequence[int]) -> float:
    """The mean, rounded to two places (0 for none)."""
    return round(sum(values) / len(values), 2) if values else 0.0


def seconds_summary(times: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of ascending durations in seconds (NaN for none)."""
    import numpy as np  # here: the load generators import this module too, and need no numpy

    if not times:
        return {"p50_s": math.nan, "p99_s": math.nan, "max_s": math.nan}
    p50, p99 = np.percentile(np.asarray(times), [50, 99], method="higher")
    return {
        "p50_s": round(float(p50), 3),
        "p99_s": round(float(p99), 3),
        "max_s": round(times[-1], 3),
    }
