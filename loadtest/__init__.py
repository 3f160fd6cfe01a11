"""Load tests for the real-time server: ``python -m loadtest SCENARIO [options]``."""
