"""A Redis connection's transport, read by a protocol of ours after redis-py's handshake.

redis-py makes the connection (TLS, ``AUTH``, ``SELECT``, the client name, from
the same URL and options as every other client) and reads it through an
``asyncio.StreamReader`` a task must wake for. The pipe and the subscriber take
the transport over from there, so each read is parsed in ``data_received``,
where it arrives. redis-py keeps its streams private; ``tests/test_pipe.py``
pins what is used here.
"""

from __future__ import annotations

import asyncio
from typing import cast

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError


def take_transport(
    connection: AbstractConnection, protocol: asyncio.Protocol, name: str
) -> tuple[asyncio.Transport, bytes]:
    """Hand ``connection``'s transport to ``protocol``: the transport, and what
    redis-py's stream had read beyond the handshake (for the protocol to parse
    first).

    A connection closed before the protocol was its own raises
    ``RedisConnectionError``: nothing would tell the protocol."""
    reader, writer = connection._reader, connection._writer
    if reader is None or writer is None:
        raise RedisConnectionError(f"the connection to {name} has no stream")
    # asyncio's or uvloop's: both hand a transport to a new protocol.
    transport = cast(asyncio.Transport, writer.transport)
    transport.set_protocol(protocol)
    leftover = bytes(reader._buffer)  # type: ignore[attr-defined]
    if reader.at_eof() or transport.is_closing():
        raise RedisConnectionError(f"{name} closed the connection at its handshake")
    return transport, leftover
