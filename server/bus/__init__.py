"""Buses: the narrow cross-node messaging interface and its implementations."""

from server.bus.base import Bus, MessageHandler
from server.bus.memory import MemoryBus, MemoryHub

__all__ = ["Bus", "MemoryBus", "MemoryHub", "MessageHandler"]
