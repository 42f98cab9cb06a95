"""Gateway: the client API (tessera.v1.Tessera), input resolution and chunk-aware routing.
``server.create_server`` serves it."""
