"""Doors into the cluster: client WebSockets, the internal HTTP API, the SQS bridge,
and notifications from the table's stream."""
