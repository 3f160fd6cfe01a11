"""The Python SDK of the Abstract Play real-time server (asyncio).

    async with RealtimeClient(url, get_token=...) as client:
        client.on("game", on_game)
        async for turn in client.turns():
            ...

The behaviour, shared with the browser SDK, is described in ``docs/clients.md``.
"""

from apclient.client import ClientStopped, GamesRefused, RealtimeClient
from apclient.events import (
    AnyEvent,
    Connected,
    Disconnected,
    Event,
    Presence,
    PresenceChange,
    RecoveryInfo,
    ResyncInfo,
    ServerError,
    State,
    Turn,
)
from apclient.storage import FileStorage, MemoryStorage, Storage
from apclient.tokens import ClientCredentials, TokenUnavailable, Unauthorized
from protocol.messages import Ply

__all__ = [
    "AnyEvent",
    "ClientCredentials",
    "ClientStopped",
    "Connected",
    "Disconnected",
    "Event",
    "FileStorage",
    "GamesRefused",
    "MemoryStorage",
    "Ply",
    "Presence",
    "PresenceChange",
    "RealtimeClient",
    "RecoveryInfo",
    "ResyncInfo",
    "ServerError",
    "State",
    "Storage",
    "TokenUnavailable",
    "Turn",
    "Unauthorized",
]
