"""Suite-wide settings.

NOTE: Triton kernels run on the CPU through Triton's interpreter, which must be chosen before
anything imports triton (the engine imports it lazily, the kernel tests eagerly); setdefault lets a
GPU machine run the same tests compiled with TRITON_INTERPRET=0.

Tests marked ``cuda`` run a GPU with the kernels compiled for it: they are skipped, with the reason,
where there is no CUDA GPU and where Triton interprets (the interpreter runs kernels on host arrays, so
the GPU tests need ``TRITON_INTERPRET=0``: ``TRITON_INTERPRET=0 make test`` on a GPU machine).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _cuda_skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "a GPU test with TRITON_INTERPRET=1 (Triton's interpreter cannot run kernels on the GPU): run with TRITON_INTERPRET=0"
    return None


def pytest_collection_modifyitems(config, items):
    cuda = [item for item in items if item.get_closest_marker("cuda") is not None]
    reason = _cuda_skip_reason() if cuda else None
    if reason is not None:
        for item in cuda:
            item.add_marker(pytest.mark.skip(reason=reason))
