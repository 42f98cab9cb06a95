"""The hand-off's tests use the engine tests' tiny models (the same session-wide fixtures, not copies)."""

from tests.engine.conftest import engine, tiny_dir, tiny_dirs  # noqa: F401  (fixtures, registered by import)
