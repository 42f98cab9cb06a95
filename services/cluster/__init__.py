"""The cluster on Ray: service actors, placement (``launch``), the ``tessera up/down/demo`` commands,
shared serving plumbing, the hand-off transport and workers' KV store access."""
