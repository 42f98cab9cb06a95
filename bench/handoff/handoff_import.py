"""The decode worker's hand-off import on the engine thread: wall time, ops and host syncs of one import.

A decode worker admits a hand-off with ``Engine.import_handoff`` on its engine thread, between two decode
steps: the batch stops meanwhile. This meter prefills a request once (``prefill_handoff``), parses the
hand-off as a decode worker receives it (``Handoff.from_bytes``: positions and hidden lists on the host;
on CUDA the K/V stay one device buffer, as the CUDA IPC transport delivers them) and imports it into the
same engine, per pass:
  import  engine-thread time of ``import_handoff`` (wall and thread CPU), its aten ops, the ops that
          launch a kernel or a copy on CUDA (and the Triton K/V writes), its likely syncs and (CUDA) the
          syncs counted by torch's sync debug mode;
  gpu     (CUDA) from the call until the GPU has finished the import's work.
Chunks are ``resident`` (in the engine's chunk cache, the common case) or ``fetched`` (evicted before each
import and served by ``fetch`` from device copies, as services/handoff/prepare.py stages them: the
``Forward.insert_chunk`` path). On the CPU the ops that would sync on CUDA are counted: nonzero, item,
unique, indexing by a boolean mask, ``Tensor.tolist`` and ``torch.tensor(list, device=...)``.

    .venv/bin/python bench/handoff/handoff_import.py [--baseline]                  # CPU: a small random Llama, 32 layers
    python3 bench/handoff/handoff_import.py --device cuda [--baseline] [--contend]  # Llama-3-8B shape, bf16 (GPU)

``--baseline`` also runs the import as it was before its tables were built on the host
(tests/handoff/handoff_import_reference.py), interleaved with the current one pass by pass.
``--contend`` (CUDA) keeps the GPU busy from a second process while measuring, as the prefill worker's
process does in the cluster benchmark: each host sync then waits for this process's turn. ``--busy F`` keeps a
second thread of this process running Python F of the time (2 ms bursts), as a decode worker's event loop and
helper threads do beside its engine thread: each torch call gives up the interpreter lock and may wait to get it
back, so an import's time grows with its number of calls. To compare two trees, run this file inside each (a
``git worktree`` of the older commit, this file copied in).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import services.engine.kv.block_pool as pool_mod  # noqa: E402
import services.engine.engine as engine_mod  # noqa: E402
from bench.handoff.handoff_export import (OpMeter, add_shared_args, build, contention, interleaved,  # noqa: E402
                                  parse_shared, request)
from services.engine import Engine, Handoff  # noqa: E402
from services.engine.kv.loader import StreamedLayer  # noqa: E402

aten = torch.ops.aten
INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class ImportMeter(OpMeter):
    """OpMeter that also counts indexing by a boolean mask (a nonzero inside the op: a sync on CUDA)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        phase = self.phase()
        if phase is not None and func in INDEX and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.syncs[f"{phase}: index by mask"] += 1
        return out


class TritonWrites:
    """While on: counts BlockPool's K/V writes that launch a Triton kernel (outside aten: the meter
    would not see them) into ``meter.launches``."""

    def __init__(self, meter: OpMeter):
        self.meter = meter

    def __enter__(self):
        self._saved = pool_mod.write_kv

        def write_kv(k, v, write, backend="torch"):
            phase = self.meter.phase()
            if phase is not None and backend == "triton":
                self.meter.launches[phase] += 1
            return self._saved(k, v, write, backend=backend)
        pool_mod.write_kv = write_kv
        return self

    def __exit__(self, *exc):
        pool_mod.write_kv = self._saved


class Baseline:
    """While on: import_handoff imports as before (tests/handoff/handoff_import_reference.py)."""

    def __enter__(self):
        from tests.handoff.handoff_import_reference import reference_import

        self._saved = engine_mod.import_sequence
        engine_mod.import_sequence = reference_import
        return self

    def __exit__(self, *exc):
        engine_mod.import_sequence = self._saved


def one_import(eng: Engine, h: Handoff, fetch, meter: bool, baseline: bool = False) -> dict:
    if baseline:
        with Baseline():
            return one_import(eng, h, fetch, meter)
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    inside = [False]
    counter = ImportMeter(lambda: "import" if inside[0] else None) if meter else None
    tolist, tensor = torch.Tensor.tolist, torch.tensor
    host_reads = Counter()

    def count_tolist(self, *a, **kw):
        if inside[0]:
            host_reads["import: tolist"] += 1
        return tolist(self, *a, **kw)

    def count_tensor(data, *a, **kw):
        if inside[0] and kw.get("device") is not None and not isinstance(data, torch.Tensor):
            host_reads["import: tensor(list, device)"] += 1
        return tensor(data, *a, **kw)

    sync()
    if meter:
        torch.Tensor.tolist, torch.tensor = count_tolist, count_tensor
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if counter is not None:
                counter.__enter__()
                triton_writes = TritonWrites(counter).__enter__()
            try:
                if cuda and meter:
                    torch.cuda.set_sync_debug_mode("warn")
                inside[0] = True
                t0, c0 = time.perf_counter(), time.thread_time()
                seq = eng.import_handoff(h, fetch=fetch)
                t1, c1 = time.perf_counter(), time.thread_time()
                inside[0] = False
            finally:
                inside[0] = False
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                if counter is not None:
                    triton_writes.__exit__(None, None, None)
                    counter.__exit__(None, None, None)
        sync()
        t2 = time.perf_counter()
    finally:
        torch.Tensor.tolist, torch.tensor = tolist, tensor
    eng.release(seq)
    row = {"import_ms": (t1 - t0) * 1e3, "import_cpu_ms": (c1 - c0) * 1e3, "gpu_ms": (t2 - t0) * 1e3,
           "private_tokens": sum(lv.positions.numel() for lv in h.layers), "chunks": len(h.chunks),
           "tables": len({id(t) for t in seq.layer_tables})}
    if meter:
        syncs = Counter(counter.syncs)
        syncs.update(host_reads)
        row.update(ops=counter.ops["import"], launches=counter.launches["import"], likely_syncs=dict(syncs))
        if cuda:
            hits = [w for w in caught if "synchroniz" in str(w.message)]
            row["cuda_syncs"] = len(hits)
            row["cuda_sync_sites"] = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in hits})
    return row


@contextlib.contextmanager
def interpreter_busy(fraction: float):
    """A thread running pure Python ``fraction`` of the time (bursts of 2 ms, then sleeps) while inside."""
    stop = threading.Event()

    def spin():
        burst = 0.002
        while not stop.is_set():
            t0, x = time.perf_counter(), 0
            while time.perf_counter() - t0 < burst:
                x += 1
            time.sleep(burst * (1 - fraction) / fraction)

    th = threading.Thread(target=spin, daemon=True) if fraction > 0 else None
    if th is not None:
        th.start()
    try:
        yield
    finally:
        stop.set()
        if th is not None:
            th.join()


def received(eng: Engine, chunks, suffix, mode: str, ratio: float) -> Handoff:
    """A hand-off as a decode worker holds it after parsing: host positions and hidden lists, the K/V one buffer
    (on CUDA a device buffer, as CUDA IPC delivers it; on the CPU a host one, as a GPU worker's import gathers a
    streamed hand-off's K/V before its one copy to the device)."""
    cuda = eng.device.type == "cuda"
    _, h = eng.prefill_handoff(chunks, suffix, mode=mode, recompute_ratio=ratio, kv_on_device=cuda)
    if cuda:
        torch.cuda.synchronize()
    return Handoff.from_bytes(h.to_bytes(with_kv=False), h.kv_buffer())


def report(row: dict) -> str:
    line = (f"{row['mode']}@{row['ratio']} {row['source']} {row['import']}: import {row['import_ms']:.3f} ms "
            f"({row['import_cpu_ms']:.3f} ms thread CPU; GPU done {row['gpu_ms']:.3f} ms); {row['chunks']} chunks, "
            f"{row['private_tokens']} private token-layers, {row['tables']} tables\n"
            f"  ops {row['ops']}, launches {row['launches']}; likely syncs {row['likely_syncs'] or 'none'}")
    if "cuda_syncs" in row:
        line += f"\n  CUDA syncs: {row['cuda_syncs']} at {row['cuda_sync_sites']}"
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shared_args(ap)
    ap.add_argument("--modes", default="tessera@0.15,full")
    ap.add_argument("--sources", default="resident,fetched", help="where the shared chunks come from")
    ap.add_argument("--baseline", action="store_true",
                    help="also the import as it was before (tests/handoff/handoff_import_reference.py), interleaved")
    ap.add_argument("--busy", type=float, default=0.0,
                    help="a second thread runs Python this fraction of the time while measuring (0 <= F < 1)")
    args = parse_shared(ap)
    if not 0 <= args.busy < 1:
        ap.error(f"--busy is a fraction in [0, 1), got {args.busy}")
    chunks, suffix = request(args)
    if args.device == "cpu":
        torch.set_num_threads(1)   # the engine thread does all of the work: its CPU time is the import's
    eng = build(args)
    with torch.no_grad():   # the chunks' K/V as the decode worker's prepare stages them: on the device
        eng.prefill(chunks, suffix, mode="tessera")
        # StreamedLayer items, as a fetch yields them (tuples are refused, and the import then computes the chunks:
        # bench/handoff/README.md)
        store = {cid: [StreamedLayer(i, k, v) for i, (k, v) in enumerate(eng.export_chunk(cid))]
                 for cid in map(eng.chunk_id, chunks)}
    variants = ["reference", "host-built"] if args.baseline else ["host-built"]
    times = ("import_ms", "import_cpu_ms", "gpu_ms")
    rows = []
    with contention(args.contend) as contended, interpreter_busy(args.busy), torch.no_grad():
        print(f"{args.device}, {eng.cfg.num_layers} layers, {args.chunks} x {args.chunk_tokens} + {args.suffix_tokens} "
              f"tokens{', GPU contended' if contended else ''}"
              f"{f', a thread running Python {args.busy:.0%} of the time' if args.busy else ''}", flush=True)
        for spec in args.modes.split(","):
            mode, _, ratio = spec.partition("@")
            ratio = float(ratio or 0.0)
            h = received(eng, chunks, suffix, mode, ratio)
            for source in args.sources.split(",") if h.chunks else ["none"]:
                def run(variant, meter):
                    if source == "fetched":
                        eng.cache.clear()    # evicted: the import writes them from the staged copies
                    return one_import(eng, h, lambda cid: iter(store[cid]), meter, variant == "reference")
                # warm-up: chunks resident or inserted once, kernels compiled
                for row in interleaved(run, variants, args.reps, times):
                    rows.append({"mode": mode, "ratio": ratio, "source": source, "import": row.pop("variant"),
                                 "busy": args.busy, **row})
                    print(report(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
