"""Registration's store writes: ``StoreAccess.put_async`` and ``PrefillWorker.warm`` computing the next
chunk while the previous one is written (the answer still waits for every acknowledgement)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from services.cluster.kvio import StoreAccess

from tests.helpers import docs

WAIT_S = 60      # bound of every wait below (never reached when the code is right)


def layers(n: int, tokens: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((tokens, 2, 8), fill + i), torch.full((tokens, 2, 8), -fill - i)) for i in range(n)]


def test_put_async_is_true_once_the_store_holds_the_chunk(tmp_path):
    from services.kvstore import BackgroundServer, StoreConfig

    srv = BackgroundServer(StoreConfig(dram_bytes=64 << 20, rocksdb_dir=str(tmp_path / "db"), write_mode="behind"))
    try:
        store = StoreAccess([srv.address], host_bytes=1 << 20)
        puts = [store.put_async(f"c{i}", layers(2, 3, float(i)), "m") for i in range(4)]
        assert [p.result(WAIT_S) for p in puts] == [True] * 4
        assert store.lookup([f"c{i}" for i in range(4)], host=False) == {f"c{i}": "dram" for i in range(4)}
        assert all(f"c{i}" in store.host for i in range(4)) and store.known_ids == {f"c{i}" for i in range(4)}
        store.close()
    finally:
        srv.stop()
    down = StoreAccess([srv.address], put_timeout=2.0)             # the shard is gone: False, not an exception
    assert down.put_async("c9", layers(1, 3, 1.0)).result(WAIT_S) is False and down.put_errors == 1
    down.close()
    assert StoreAccess([]).put_async("c9", layers(1, 3, 1.0)).result(WAIT_S) is False   # no store at all


class _GatedStore:
    """StoreAccess's surface for ``warm``: holds ``held``; each put's future is settled by the test."""

    enabled = True

    def __init__(self, held=()):
        self.held, self.puts = set(held), {}
        self.changed = threading.Condition()

    def lookup(self, ids, host=True):
        return {cid: "dram" for cid in ids if cid in self.held}

    def put_async(self, cid, layers, fingerprint=""):
        with self.changed:
            self.puts[cid] = Future()
            self.changed.notify_all()
            return self.puts[cid]

    def wait_for_puts(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.puts) >= n, WAIT_S), f"{len(self.puts)} puts, wanted {n}"


def test_warm_computes_the_next_chunk_while_the_previous_is_written(tiny_model):
    from services.engine import Engine
    from services.prefill.controller import LoadingController
    from services.prefill.metrics import PrefillMetrics
    from services.prefill.worker import PrefillWorker

    eng = Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    chunks = docs(5, 24, seed=61)
    ids = [eng.chunk_id(c) for c in chunks]
    store = _GatedStore(held=[ids[1]])                               # chunk 1 is stored already
    worker = PrefillWorker(eng, store, LoadingController(), PrefillMetrics())
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(worker.warm(chunks + [chunks[0]])))
    thread.start()
    # chunks 0, 2 and 3 are computed and handed to the put thread with no write acknowledged yet...
    store.wait_for_puts(3)
    assert list(store.puts) == [ids[0], ids[2], ids[3]] and not answer
    # ...then at most 3 writes are queued: chunk 4 waits for the first write to finish
    assert ids[4] not in store.puts
    store.puts[ids[0]].set_result(True)
    store.wait_for_puts(4)
    store.puts[ids[2]].set_result(False)                             # this write failed
    store.puts[ids[3]].set_result(True)
    assert not answer                                                # still waiting for chunk 4's write
    store.puts[ids[4]].set_result(True)
    thread.join(WAIT_S)
    assert answer == [[True, True, False, True, True, True]]        # the repeated chunk 0 answered once, stored
    assert len(store.puts) == 4                                      # the held chunk was not written again
