"""GPU check of chunk reads from this host's store arena onto the device (``KVStoreClient.device_read`` through
``kvio.DeviceLayers``): a prefill whose chunks are read from a store shard's arena gives the logits of the same
prefill over the chunks computed in place; a chunk whose bytes in the arena are damaged fails its check on the GPU
and is recomputed before any layer is used, and the logits do not change.

    python -m tests.kvstore.gpu_arena_loads      # prints "arena reads onto cuda: ok" (exit 0) or what differs

Importable without pytest (a GPU host may have none); ``tests/kvstore/test_arena.py`` covers the same path on the
CPU (the checksum's twin).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def check(n_chunks: int = 4, length: int = 300, device: str = "cuda") -> str:
    """'' when both passes hold, else what went wrong (``device`` cpu: with ``KVStoreClient.check_on`` taking it,
    the same path through the checksum's twin)."""
    sys.path.insert(0, str(REPO / "bench" / "kvstore"))
    from store_to_gpu import start_store

    from services.cluster.kvio import StoreAccess
    from services.engine import Engine
    from services.engine.model.tiny import write_tiny
    from services.kvstore.client import KVStoreClient

    work = Path(tempfile.mkdtemp(prefix="tessera-gpu-arena-"))
    shm = tempfile.mkdtemp(prefix="tessera-gpu-arena-", dir="/dev/shm")
    proc = None
    try:
        model = write_tiny(work / "tiny", max_position_embeddings=4096)
        eng = Engine.load(str(model), device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        eng.forward.tails = None        # both passes eager: the same kernels, so equal logits are expected
        rng = random.Random(0)
        chunks = [[rng.randrange(256) for _ in range(length + 5 * i)] for i in range(n_chunks)]
        suffix = [rng.randrange(256) for _ in range(20)]
        want = eng.prefill(chunks, suffix, recompute_ratio=0.15).logits.float()
        ids = [eng.chunk_id(c) for c in chunks]
        proc, address = start_store(256 << 20, work / "store", os.path.join(shm, "dram"), 64 << 20)
        writer = KVStoreClient(address, timeout=60)
        for cid in ids:
            writer.put(cid, [(k.cpu(), v.cpu()) for k, v in eng.export_chunk(cid)], model_fingerprint=eng.fingerprint)
        for damage in (False, True):
            eng.cache.clear()
            access = StoreAccess([address])
            try:
                present = access.lookup(ids)
                if damage:              # one byte of the second chunk's first layer, in the store's segment
                    place = access._places[ids[1]].layers
                    with open(place.path, "r+b") as f:
                        f.seek(place.offsets[0] + 7)
                        byte = f.read(1)
                        f.seek(place.offsets[0] + 7)
                        f.write(bytes([byte[0] ^ 0x10]))
                res, _ = eng.prefill_handoff(chunks, suffix, recompute_ratio=0.15,
                                             fetch=access.fetcher(present, eng.device))
                [client] = access._client.clients()
                if (res.stats.load_failures, client.reads["arena-device"]) != (int(damage), n_chunks):
                    return (f"damage={damage}: {res.stats.load_failures} failed loads, {client.reads} reads "
                            f"(expected {int(damage)} and {n_chunks} onto the device)")
                worst = (res.logits.float() - want).abs().max().item()
                if worst != 0.0:
                    return f"damage={damage}: logits differ by up to {worst:g}"
            finally:
                access.close()
        return ""
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 0
    wrong = check()
    if wrong:
        print(f"arena reads onto cuda: {wrong}")
        return 1
    print("arena reads onto cuda: ok (equal logits; a damaged chunk refused on the GPU and recomputed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
