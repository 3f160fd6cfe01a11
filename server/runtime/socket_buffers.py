"""The kernel's part of a socket's outbox: how much it may hold, and how much it holds.

A session's unsent bytes are the transport's write buffer plus these; the slow-consumer
check adds them up (``Session.over_limit``).
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios

_SIOCOUTQ = getattr(termios, "TIOCOUTQ", None)  # the same request as SIOCOUTQ on Linux


def kernel_send_capacity(transport: asyncio.BaseTransport) -> int:
    """Most bytes the kernel may hold for this socket (SO_SNDBUF as the kernel reports it)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        capacity: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    except OSError:
        return 0
    return capacity


def kernel_unsent(transport: asyncio.BaseTransport, capacity: int) -> int:
    """Bytes in the kernel's send queue; ``capacity`` where that cannot be read."""
    sock = transport.get_extra_info("socket")
    if sock is None or _SIOCOUTQ is None:
        return capacity
    try:
        raw = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return capacity
    unsent: int = struct.unpack("i", raw)[0]
    return unsent
