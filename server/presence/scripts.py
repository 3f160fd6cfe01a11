"""The Lua scripts behind cluster presence, each one atomic in Redis.

All keys share the ``{presence}`` hash tag (one Redis Cluster slot), so each
script may read and write any of them, and both presence channels carry the
same tag, so on a cluster the script publishes with ``SPUBLISH`` on the shard
that runs it (:func:`~server.redis.scripts.for_bus`). Times come from Redis
``TIME``, never from a node's clock. Hints built here are the msgpack envelopes
of :mod:`protocol.envelope` (``{"v": 1, "k": "hint", "node": id, "users": [...]}``).
The sources are in ``server/presence/lua/``; ``docs/lua.md`` lists them. The
writer lease is :class:`~server.coordination.lease.RedisLease`, whose token
``COMMIT`` checks.
"""

from __future__ import annotations

from protocol.envelope import ENVELOPE_VERSION
from server.redis.scripts import lua

_VALUES = {"ENVELOPE_VERSION": ENVELOPE_VERSION}


def _script(*names: str) -> str:
    return lua("server.presence", *names, values=_VALUES)


REPORT = _script("report")
REGISTER = _script("prelude", "register")
HEARTBEAT = _script("heartbeat")
DEREGISTER = _script("prelude", "deregister")
SWEEP = _script("prelude", "sweep")
ONLINE = _script("online")
READ_COMMITTED = _script("read_committed")
INIT_COMMITTED = _script("init_committed")
COMMIT = _script("commit")
