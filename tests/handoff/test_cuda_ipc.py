"""The CUDA IPC hand-off path between two processes on one GPU and on two (skipped without them; on a GPU host
``python -m tests.handoff.ipc_child`` runs the same check without pytest)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cuda


def test_a_buffer_shared_with_another_process_arrives_whole():
    from .ipc_child import round_trip

    assert round_trip()


def test_a_buffer_copied_to_a_process_of_another_gpu_arrives_whole():
    import torch

    from .ipc_child import round_trip

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    assert round_trip(peer=True)


def test_pieces_of_one_slab_arrive_whole_and_the_receiver_opens_the_slab_once():
    from .ipc_child import slab_round_trip

    assert slab_round_trip()


@pytest.mark.parametrize("on_sender", [False, True])
def test_pieces_of_a_slab_of_another_gpu_arrive_whole_opened_on_either_gpu(on_sender):
    import torch

    from .ipc_child import slab_round_trip

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    assert slab_round_trip(peer=True, on_sender=on_sender)
