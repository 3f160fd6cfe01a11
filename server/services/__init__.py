"""Domain services the node owns (bots, chat, lastSeen, ...), each behind the store and bus
interfaces, with memory parts for the embedded default and Redis parts for a cluster."""
