import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The quality model is tiny: a second intra-op thread buys nothing and, on a busy 2-core
    machine, makes every small op wait for a descheduled peer (5-10x slower). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
