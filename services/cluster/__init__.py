"""The cluster's plumbing, shared by the gateway and the workers and free of both: their configuration,
serving helpers (loop thread, ports, health), the hand-off transport, the workers' KV store access and host
tier, sampling on the wire, profiling, and the services' mutual TLS and authorization. Nothing here imports a
worker or the launchers (services/launch/), which put these pieces together."""
