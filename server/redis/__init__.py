"""Redis plumbing shared by the bus, streams and coordination: pipelines, coalescing."""
