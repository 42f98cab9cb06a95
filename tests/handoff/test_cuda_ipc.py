"""The CUDA IPC hand-off path between two processes on one GPU (skipped without CUDA; on a GPU host
``python -m tests.handoff.ipc_child`` runs the same check without pytest)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cuda


def test_a_buffer_shared_with_another_process_arrives_whole():
    from .ipc_child import round_trip

    assert round_trip()
