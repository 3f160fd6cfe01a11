"""Processes under test, the worker pool and the run's phases."""
