"""Presence: local counts, the writer, the view; the Redis backend and its scripts."""
