"""Decode worker: receives hand-offs, rebuilds sequences and decodes them with continuous batching.
``server.create_server`` serves it; ``batcher.Batcher`` is the engine loop."""
