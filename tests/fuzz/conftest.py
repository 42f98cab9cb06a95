"""Fixtures of the fuzz tests: per module, the services run in this process (the tiny model: tests/conftest.py).

Fuzz tests are bounded so that the folder runs in well under three minutes on 2 CPU cores: each property
draws a fixed, derandomized set of examples (``tests/fuzz/common.py``); those that start servers are
marked ``slow``.
"""

from __future__ import annotations

import pytest

from tests.helpers import InProcessCluster

TOKEN = "sesame"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """Gateway (bearer token ``TOKEN``), one prefill, one decode and one store shard in this process."""
    c = InProcessCluster(tiny_model, tmp_path_factory.mktemp("rocksdb"), token=TOKEN)
    yield c
    c.stop()
