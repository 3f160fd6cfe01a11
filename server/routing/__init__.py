"""From the bus to sockets: the hub's indexes, delivery in stream order with repair,
client recovery, and the batched history reads and subscribes behind them."""
