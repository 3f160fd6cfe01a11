"""What to do after a socket closes, and how long to wait: pure, so every case is
unit-tested. The browser SDK (clients/js/src/policy.ts) follows the same table."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

BACKOFF_MIN = 0.5
"""Floor of an ordinary backoff step, seconds."""
BACKOFF_MAX = 30.0
"""Ceiling of every backoff step."""
OVERLOAD_MIN = 5.0
"""The floor when the server said it is overloaded (1013, an upgrade refused with 503)."""
RESTART_SPREAD = 3.0
"""A drained node (1012) sends everyone away at once: they come back over this window."""
FIRST_CEILING = 2.0
"""The first step's ceiling at least. A node that dies drops all its clients in the same
instant; their first retries, spread over 1.5 s, reach the other nodes at a pace they
admit (``--accept-rate``) rather than as a wave that gets 503s and the longer floor."""


def backoff_delay(
    attempt: int,
    minimum: float = BACKOFF_MIN,
    maximum: float = BACKOFF_MAX,
    rand: Callable[[], float] = random.random,
) -> float:
    """Exponential backoff with full jitter: uniform over ``[minimum, min(maximum,
    max(2 * minimum, FIRST_CEILING) * 2 ** attempt)]``, where ``attempt`` counts the
    failures since the last acknowledged subscribe, from 0: 0.5-2 s, 0.5-4 s, ...
    0.5-30 s; after an overload 5-10 s, 5-20 s, 5-30 s."""
    first = max(2 * minimum, FIRST_CEILING)
    ceiling = min(maximum, first * float(2 ** min(attempt, 16)))
    return minimum + rand() * (max(ceiling, minimum) - minimum)


class Wait(Enum):
    """How the next attempt waits."""

    RESTART = "restart"  # a random 0-3 s, no backoff step: the node drains, the cluster is fine
    BACKOFF = "backoff"  # the next backoff step
    OVERLOAD = "overload"  # the next backoff step, with the longer floor
    REFRESH = "refresh"  # the next backoff step, with a token refresh
    VISIBLE = "visible"  # a browser waits for the page to be visible; elsewhere as BACKOFF


@dataclass(frozen=True, slots=True)
class Plan:
    stop: bool
    wait: Wait = Wait.BACKOFF
    log: str | None = None
    bug: bool = False  # the close points to a bug in the client


def close_plan(code: int, *, opened: bool, error: str | None, refreshed: bool) -> Plan:
    """The plan after a close with ``code``.

    ``opened``: whether the socket ever opened (a refused upgrade did not);
    ``error``: the code of the last error frame on the socket, which tells a
    flood's 1008 from a token's; ``refreshed``: whether this run of 1008s had
    its one token refresh already.
    """
    if code == 4509:
        return Plan(stop=True, log="too many connections for this user (4509): stopped")
    if code == 1008:
        if error == "rate_limited":
            return Plan(
                stop=False,
                wait=Wait.OVERLOAD,
                bug=True,
                log="closed for flooding the server (1008 rate_limited)",
            )
        if refreshed:
            return Plan(stop=True, log="unauthorized after a token refresh (1008): stopped")
        return Plan(stop=False, wait=Wait.REFRESH)
    if code == 1012:
        return Plan(stop=False, wait=Wait.RESTART)
    if code == 1013 or not opened:
        return Plan(stop=False, wait=Wait.OVERLOAD)
    if code == 4008:
        return Plan(
            stop=False,
            log="closed as a slow consumer (4008): reconnecting and recovering",
        )
    if code == 4408:
        return Plan(stop=False, bug=True, log="no subscribe within the server's timeout (4408)")
    if code == 1001:
        return Plan(stop=False, wait=Wait.VISIBLE)
    return Plan(stop=False)


def connect_plan(*, status: int | None, timed_out: bool = False) -> Plan:
    """The plan after a connect that never became a socket.

    ``status``: the HTTP status that answered the upgrade, if any. A 503 (the
    node is full, or takes connections faster than its accept rate) and a
    connect that timed out are overload; a refused or reset connection (a node
    that is down or restarting) is an ordinary failure: the next address may
    well answer at once.
    """
    if status in (429, 503) or timed_out:
        return Plan(stop=False, wait=Wait.OVERLOAD)
    if status is not None:
        return Plan(stop=False, log=f"the upgrade was answered with HTTP {status}")
    return Plan(stop=False)


def wait_seconds(
    wait: Wait,
    attempt: int,
    retry_after: float = 0.0,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before the next attempt; ``retry_after`` is a 503's header."""
    if wait is Wait.RESTART:
        return rand() * RESTART_SPREAD
    floor = OVERLOAD_MIN if wait is Wait.OVERLOAD else BACKOFF_MIN
    return max(retry_after, backoff_delay(attempt, floor, rand=rand))
