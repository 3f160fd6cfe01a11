"""The process around the node: metrics, logs, pauses, reclaim, write-behind, task helpers."""
