"""Redis plumbing shared by the bus, streams, presence and coordination: clients,
scripts, key layout, pipelines, coalescing."""
