"""Cluster-wide coordination primitives: lease, dedup, game locks, rate limits, claims."""
