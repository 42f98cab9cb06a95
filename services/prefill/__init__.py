"""Prefill worker: chunk KV from the device cache, the KV store (layer-streamed) or computed; blend;
hand-off to a decode worker. ``server.create_server`` serves it; ``worker.PrefillWorker`` is its engine side."""
