"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

NOTE: TRITON_INTERPRET must be set before anything imports triton (kernels decorated while it is
unset compile for a GPU); setdefault lets a GPU run choose TRITON_INTERPRET=0 explicitly.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
