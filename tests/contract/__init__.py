"""The Store contract suite, run against every implementation."""
