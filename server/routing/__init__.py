"""From the bus to sockets: history reads and batched subscribes behind the hub."""
