"""The decode worker's index service as its engine's index set (services/decode/indexes.py): calls pass through, owners
under a prefix of the worker process's own (a restarted worker's sequences do not collide with its predecessor's); a
service that is not there, or lost what it held, fails the call at once with IndexUnavailable naming the status and
not the address; a failed drop is logged and left. The batcher's side: tests/decode/test_batcher.py."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from services.decode.indexes import IndexUnavailable, RemoteIndexes
from services.index.client import IndexClient

HKV, N, D, HQ = 2, 64, 8, 4


def _closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _data():
    rng = np.random.default_rng(3)
    keys, values = (rng.standard_normal((HKV, N, D)).astype(np.float32) for _ in range(2))
    return keys, values, rng.standard_normal((HKV, 16, D)).astype(np.float32)


def test_an_unreachable_service_fails_each_call_at_once_and_clearly():
    address = _closed_address()
    indexes = RemoteIndexes(IndexClient(address, timeout=5, offload_timeout=5))
    q = np.ones((1, HQ, D), np.float32)
    t0 = time.monotonic()
    with pytest.raises(IndexUnavailable, match="failed to take layer 0 of the sequence's keys: UNAVAILABLE") as err:
        indexes.add("seq0", 0, *_data())
    assert address not in str(err.value) and "decode='retrieval'" in str(err.value)
    with pytest.raises(IndexUnavailable, match="failed to search layer 3: UNAVAILABLE"):
        indexes.attend(3, ["seq0"], q, 5, 0.1)
    with pytest.raises(IndexUnavailable, match="failed to hold layer 1 of the sequence's keys: UNAVAILABLE"):
        indexes.hold("seq0", 1, *_data()[:2])
    indexes.hold("seq0", 2, np.zeros((HKV, 0, D), np.float32), np.zeros((HKV, 0, D), np.float32))   # nothing sent
    assert indexes.drop("seq0") == 0            # logged, never raised: a release must not fail
    assert time.monotonic() - t0 < 5            # refused connections: no wait for the deadline
    indexes.close()


def test_calls_pass_through_and_a_search_of_what_the_service_lost_says_so():
    from services.index.server import BackgroundIndexServer

    keys, values, train = _data()
    q = np.random.default_rng(4).standard_normal((1, HQ, D)).astype(np.float32)
    with BackgroundIndexServer(threads=1) as srv:
        # the first build in a fresh checkout compiles the index's numba loops: minutes on a busy 2-core machine
        indexes = RemoteIndexes(IndexClient(srv.address, timeout=10, offload_timeout=300))
        assert indexes.add("seq1", 0, keys, values, train) > 0
        ans = indexes.attend(0, ["seq1"], q, 10_000, 0.3)
        assert ans.out.shape == (1, HQ, D) and ans.scanned[0] > 0
        assert indexes.held()[0] == 1 and indexes.nbytes() == keys.nbytes + values.nbytes
        # a restarted worker numbers its sequences from 0 again: what the earlier process left does not refuse them
        again = RemoteIndexes(IndexClient(srv.address, timeout=10, offload_timeout=300))
        assert again.add("seq1", 0, keys[:, :10], values[:, :10], train) > 0 and again.held()[0] == 2
        assert again.attend(0, ["seq1"], q, 10_000, 0.3).scanned[0] < ans.scanned[0]
        # held (scanned whole, exactly), then indexed by an add that sends no keys again
        indexes.hold("seq2", 0, keys, values)
        scanned = indexes.attend(0, ["seq2"], q, 5, 0.3)
        assert scanned.scanned[0] == N * HKV                    # every key of each KV head (its group searched once)
        codes = indexes.held()[2]                               # the held keys' int8 codes, and no graph yet
        assert indexes.add("seq2", 0, keys, values, train) > 0 and indexes.held()[2] > codes
        assert indexes.drop("seq2") == 1
        assert indexes.drop("seq1") == 1 and again.drop("seq1") == 1
        with pytest.raises(IndexUnavailable, match="NOT_FOUND .it no longer holds the sequence's keys"):
            indexes.attend(0, ["seq1"], q, 5, 0.3)
        indexes.close()
        again.close()
