"""Doors into the cluster besides client sockets: the internal HTTP API."""
