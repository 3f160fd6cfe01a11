"""Presence: local counts, the writer, the view (core); one node's part in it
(node_presence); the Redis backend and its scripts."""
