"""Generated gRPC stubs for ``proto/*.proto`` (committed; ``make proto`` regenerates them)."""
