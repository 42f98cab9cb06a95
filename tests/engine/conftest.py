"""Fixtures for the engine tests: tiny models written once per session, random token data."""

from __future__ import annotations

import os

import pytest
import torch

from services.engine import Engine
from services.engine.model.tiny import write_tiny


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """arch -> directory of a tiny random model of that architecture."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny(root / arch, arch=arch, seed=7)
            for arch in ("llama", "llama3", "mistral", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture
def engine(tiny_dir):
    return Engine.load(tiny_dir, device="cpu", dtype=torch.float32)


def random_request(seed: int, lengths=(20, 33, 17), suffix_len=7, vocab=256):
    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    suffix = torch.randint(0, vocab, (suffix_len,), generator=g).tolist()
    return chunks, suffix


def cpu_triton() -> None:
    """Skip unless Triton kernels can run on the CPU (its interpreter): a GPU machine running the suite
    compiled (TRITON_INTERPRET=0) has no CPU Triton, and CPU engines refuse the Triton backend there."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU engines with Triton kernels need TRITON_INTERPRET=1")


def tail_replays(eng) -> int:
    """Static-tail replays of every kind: general tails, the ratio-0 reuse passes' id tails and the ratio > 0
    passes' blend tails."""
    fwd = eng.forward
    return fwd.tails.replays + sum(t.replays for t in (fwd.id_tails, fwd.blend_tails) if t is not None)
