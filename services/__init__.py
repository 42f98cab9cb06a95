"""Tessera services: engine, prefill/decode workers, KV store, retrieval index, gateway, SDK."""
