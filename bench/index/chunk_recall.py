"""Recall@k of an index composed from chunk graphs (built once, in each chunk's frame), alone and repaired with the
request's own queries, against one index built per request, on the longgen quality model's queries and keys; the
chunks also placed far from where they were built.

Data (``loadgen/quality/qk_dump.py``): every (layer, KV head) of the trained longgen model, ``--prompts`` held-out
prompts in the *spread* layout: prompt p runs alone at positions 0..T-1 and is then rotated on by its offset (the
earlier prompts' prompt and answer lengths), so the pool is one request of P x 12 chunks whose every key has its own
global position. NOTE: pooled, not per prompt: one prompt holds 787 keys, where k = 100 is an eighth of the pool and a
beam of 128 already scores a large part of it; in the spread layout every chunk's offset is still unambiguous
(prompt offset + 1 + 64c: ``<bos>`` at 0, 64-token chunks, an 18-token question suffix). The searched queries are
the answer-position queries (every query head of the group), held out of every build; truth and recall as in
``recall.py`` (exact inner products over the pool, ties count).

Composed index (the engine's path, ``services/engine/decode/retrieval.py``): each chunk's keys are rotated back by
its global offset into its own frame (positions 0..63; checked by assertion against the model's RoPE: forth again
gives the dump's keys, and the same keys from the stacked dump rotated back by the in-prompt offset); its training
queries are the dump's prefill queries at the chunk's positions, rotated back by the same offset and then forward by
``CHUNK_QUERY_SHIFTS`` x the model's 1024 positions, in turn (as ``chunk_inputs`` does). NOTE: the engine taps a
chunk's queries from the chunk run alone; the dump's queries saw the earlier chunks too (layers >= 1), rotated back
they are a fair stand-in for them, with the same positions and projections. Likewise the keys are the request's
own (as if CacheBlend had recomputed every token). ``ChunkIndex.build`` (one thread, the chunk defaults unless
``--sweep`` varies them) makes the chunk's graphs; the request composes them over its keys at their global positions
(``AttentionIndex.compose``), chunks first in position order, then one graph built over the rest (each prompt's
``<bos>`` and suffix) from the request's prefill queries, as ``IndexSet.add`` does. Per-request index (today's
path): ``AttentionIndex.build`` over every key. Both take the request's prefill queries strided to
``TRAIN_QUERIES`` positions, as the engine's ``QueryTap`` keeps them (every query head of the group each).

Repaired composed index (``IndexSet.add`` whenever the request has queries): the composed index above,
``.repaired(train)`` with those same request queries of the head (the build's step 4 across parts, with the options
``IndexSet.add`` composes with, ``heads.COMPOSED``: one round; ``--repair-rounds`` for another count).
``--subsample`` repeats it at +0 with a seeded sample of that many of the
training queries a head (the repair's cost grows with them).

Far offsets (``--offsets``): every key and answer query rotated on by the same extra distance, past the model's
1,024 positions (scores are unchanged up to rounding): the composed index reuses its chunk graphs and rebuilds
only the rest's graph, the repaired one that and the repair; the per-request index is rebuilt. Builds and repairs
are timed on one thread each.

    .venv/bin/python bench/index/chunk_recall.py     # writes bench/index/DATE_cpu_COMMIT_chunk_recall.{json,png}
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.index.recall import at_recall, recall                              # noqa: E402
from loadgen.quality.model import ModelConfig                                 # noqa: E402
from loadgen.quality.qk_dump import dump_qk, model_dir                        # noqa: E402
from loadgen.quality.tasks import longgen_heldout                             # noqa: E402
from loadgen.quality.vocab import vocab                                       # noqa: E402
from services.engine.decode.retrieval import CHUNK_QUERY_SHIFTS, TRAIN_QUERIES  # noqa: E402
from services.index import AttentionIndex                                     # noqa: E402
from services.index.build import BuildConfig                                  # noqa: E402
from services.index.chunks import ChunkIndex                                  # noqa: E402
from services.index.heads import COMPOSED                                     # noqa: E402

# one option changed at a time from ChunkIndex's defaults (its own entries and training-query cap, BuildConfig's rest)
SWEEP = [{}, {"repair_rounds": 0}, {"repair_rounds": 1}, {"repair_queries": 512}, {"repair_queries": 2048},
         {"entries": 4}, {"entries": 8}, {"entries": 16}, {"build_beam": 32}, {"query_neighbors": 32},
         {"degree": 16, "max_degree": 32}]


def rotate(x: np.ndarray, positions, inv_freq: np.ndarray) -> np.ndarray:
    """x float32 [n, D] rotated by ``positions`` (int, or [n]), NeoX halves as the model's ``apply_rope``; in fp64."""
    angles = np.asarray(positions, np.float64).reshape(-1, 1) * inv_freq                  # [n or 1, D/2]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
    return np.ascontiguousarray(np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1), np.float32)


def layout(prompts: int, seed: int, merge: int = 1):
    """Per prompt: (pool index of its ``<bos>``, global offset); chunks [(pool start, global offset, length)]; the
    rest's pool indices; keys in all. ``merge``: each run of that many consecutive 64-token chunks of a prompt taken as
    one chunk (larger chunks, as an 8B model's 512-token ones; a prompt's last run may be shorter)."""
    v = vocab()
    starts, chunks, rest, at, offset = [], [], [], 0, 0
    for p in longgen_heldout(seed, prompts):
        starts.append((at, offset))
        rest.append(at)
        pos = 1
        for i in range(0, len(p.chunks), merge):
            length = sum(len(c) for c in p.chunks[i:i + merge])
            chunks.append((at + pos, offset + pos, length))
            pos += length
        rest.extend(range(at + pos, at + pos + len(p.suffix(v))))
        pos += len(p.suffix(v))
        at, offset = at + pos, offset + pos + len(p.target(v))
    return starts, chunks, np.array(rest, np.int64), at


def chunk_frames(heads, stacked, starts, chunks, group, inv_freq, max_positions):
    """Per chunk: keys [layer][Hkv, L, D] and training queries [layer][Hkv, L * group, D] in its frame."""
    n, layers, hkv = heads[0].keys.shape[0], 1 + max(h.layer for h in heads), 1 + max(h.kv_head for h in heads)
    shifts = np.array([int(f * max_positions) for f in CHUNK_QUERY_SHIFTS])
    prompt_of = np.searchsorted([a for a, _ in starts], [a for a, _, _ in chunks], side="right") - 1
    out = []
    for (a, offset, length), p in zip(chunks, prompt_of):
        keys = [np.empty((hkv, length, heads[0].keys.shape[1]), np.float32) for _ in range(layers)]
        train = [np.empty((hkv, length * group, heads[0].keys.shape[1]), np.float32) for _ in range(layers)]
        for h, s in zip(heads, stacked):
            k = rotate(h.keys[a:a + length], -offset, inv_freq)
            scale = np.abs(h.keys[a:a + length]).max()
            assert np.abs(rotate(k, offset, inv_freq) - h.keys[a:a + length]).max() < 1e-5 * scale, "round trip"
            in_prompt = a - starts[p][0]           # the chunk's offset in its prompt: the stacked dump's frame
            assert np.abs(rotate(s.keys[a:a + length], -in_prompt, inv_freq) - k).max() < 5e-3 * scale, "offsets"
            keys[h.layer][h.kv_head] = k
            q = np.stack([h.queries[j * n + a:j * n + a + length] for j in range(group)], 1)   # [L, g, D]
            local = -offset + shifts[np.arange(length) % len(shifts)]                         # position t: shift t % 4
            train[h.layer][h.kv_head] = rotate(q.reshape(-1, q.shape[-1]), np.repeat(local, group), inv_freq)
        out.append((keys, train))
    return out


def request_queries(head, n: int, group: int) -> np.ndarray:
    """The request's prefill queries as ``QueryTap`` keeps them: positions strided to TRAIN_QUERIES, every head."""
    pos = np.arange(0, n, -(-n // TRAIN_QUERIES))
    return np.ascontiguousarray(np.stack([head.queries[j * n + pos] for j in range(group)], 1).reshape(-1, head.keys.shape[1]))


def curve(index, keys, queries, kth, k, beams):
    rows = []
    for beam in beams:
        ids, scanned = index.search(queries, k, beam=beam)
        rows.append({"beam": beam, "recall": recall(keys, queries, ids, kth), "scanned": float(scanned.mean() / len(keys))})
    return rows, ids


def kth_scores(keys, queries, k):
    import faiss

    flat = faiss.IndexFlatIP(keys.shape[1])
    flat.add(keys)
    return flat.search(queries, k)[0][:, -1]


def build_chunks(frames, options):
    """Every chunk's ChunkIndex on one thread; (indexes, seconds a graph, a digest of their bytes)."""
    built, digest = [], hashlib.blake2b(digest_size=8)
    t0 = time.perf_counter()
    for keys, train in frames:
        built.append(ChunkIndex.build(keys, train, threads=1, **options))
    seconds = time.perf_counter() - t0
    for g in (g for c in built for gs in c.graphs for g in gs):
        for arr in (g.offsets, g.targets, g.entries):
            digest.update(arr.tobytes())
    graphs = len(built) * built[0].num_layers * built[0].num_heads
    return built, seconds / graphs, digest.hexdigest()


def mean_rows(per_head):
    return [{"beam": rows[0]["beam"], "recall": float(np.mean([r["recall"] for r in rows])),
             "scanned": float(np.mean([r["scanned"] for r in rows]))} for rows in zip(*per_head)]


def recall_at(rows, budget):
    """Recall where the mean curve reaches scanned = budget, interpolated; None outside its points (no beam scanned
    that little, or none that much)."""
    pts = sorted((r["scanned"], r["recall"]) for r in rows)
    for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
        if s0 <= budget <= s1:
            return r0 + (r1 - r0) * (budget - s0) / (s1 - s0)
    return None


def reach(per_head, target):
    each = [at_recall([(r["recall"], r["scanned"]) for r in rows], target) for rows in per_head]
    return {"mean": None if None in each else float(np.mean(each)), "max": None if None in each else max(each)}


COLORS = {"composed": "tab:red", "repaired": "tab:green", "per_request": "tab:blue"}


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + bool(doc.get("repair_subsample")) + bool(doc["sweep"])
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.6), dpi=120, squeeze=False)
    axes = list(axes[0])
    per_request = doc["curves"]["0"]["per_request"]["mean"]
    ax = axes[0]
    for offset, style, marker in zip(["0", *map(str, doc["offsets"])], ["-", "--", ":"], ["o", "x", "+"]):
        for name, curves in doc["curves"][offset].items():
            rows = curves["mean"]     # far offsets: drawn over +0 (the same to rounding)
            ax.plot([100 * r["scanned"] for r in rows], [r["recall"] for r in rows], style, marker=marker,
                    markersize=9 if marker == "+" else 6, color=COLORS[name], label=f"{name.replace('_', '-')}, +{offset}")
    ax.set_title(f"composed chunk graphs, alone and repaired, vs one index per request (mean of {doc['heads']} heads)",
                 fontsize=9)
    if doc.get("repair_subsample"):
        ax = axes[1]
        full = np.mean([b["repair_s"] for b in doc["builds"]])
        runs = [(doc["train_queries_per_request"], full, doc["curves"]["0"]["repaired"]["mean"])]
        runs += [(s["queries"], s["repair_s"], s["mean"]) for s in doc["repair_subsample"]]
        for (queries, seconds, rows), color in zip(runs, ["tab:green", "tab:olive", "tab:purple", "tab:brown"]):
            ax.plot([100 * r["scanned"] for r in rows], [r["recall"] for r in rows], marker=".", color=color,
                    label=f"repaired from {queries} queries a head ({seconds:.2f} s a head)")
        for name in ("per_request", "composed"):
            rows = doc["curves"]["0"][name]["mean"]
            ax.plot([100 * r["scanned"] for r in rows], [r["recall"] for r in rows], "--", linewidth=1,
                    color=COLORS[name], label=name.replace("_", "-"))
        ax.set_title("repaired composition, the repair's training queries subsampled (+0)", fontsize=9)
    if doc["sweep"]:
        ax = axes[-1]
        for i, s in enumerate(doc["sweep"]):
            rows = s["mean"]
            ax.plot([100 * r["scanned"] for r in rows], [r["recall"] for r in rows], marker=".", linewidth=1,
                    color=plt.cm.tab20(i), label=f"{s['name']} ({1e3 * s['seconds_per_graph']:.1f} ms/graph)")
        ax.plot([100 * r["scanned"] for r in per_request], [r["recall"] for r in per_request], "k--", linewidth=1,
                label="per-request")
        ax.set_title("composed (not repaired), chunk build options (one changed from the default)", fontsize=9)
    for ax in axes:
        ax.set_xscale("log")
        ticks = [2, 3, 5, 10, 20, 30, 50, 100]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("keys scanned (% of the request's keys)")
        ax.set_ylabel(f"recall@{doc['k']}")
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=0.8)
        ax.grid(True, alpha=0.3)
    for ax in axes[:2 if doc.get("repair_subsample") else 1]:
        ax.legend(fontsize=7, loc="lower right")
    if doc["sweep"]:
        axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"longgen model, {doc['prompts']} prompts spread ({doc['num_keys']} keys, {doc['num_chunks']} "
                 f"chunks of {64 * doc.get('merge', 1)}), {doc['heldout_queries']} held-out answer queries a head; CPU, commit {doc['commit']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-k", type=int, default=100)
    ap.add_argument("--beams", default="100,128,160,200,260,350,500,800")
    ap.add_argument("--offsets", default="4096,60000", help="extra distances the request is placed at")
    ap.add_argument("--budgets", default="0.2,0.3", help="scanned fractions recall is reported at")
    ap.add_argument("--subsample", default="1024,512", help="training queries a head the repair also runs with, at +0")
    ap.add_argument("--sweep", default="all", help="'all', 'none' or indices into SWEEP, e.g. 0,5")
    ap.add_argument("--what", default="chunk_recall")
    ap.add_argument("--merge", type=int, default=1, help="consecutive 64-token chunks of a prompt taken as one chunk")
    ap.add_argument("--chunk-options", default="{}",
                    help="BuildConfig options of the chunks' graphs (JSON; the chunk defaults otherwise)")
    ap.add_argument("--repair-rounds", type=int, default=None,
                    help="the repair's rounds (default: what IndexSet.add uses, services/index/heads.py COMPOSED)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG beside a run's JSON")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    commit = os.environ.get("COMMIT") or os.environ.get("TESSERA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True, check=True).stdout.strip()
    beams = [int(x) for x in args.beams.split(",")]
    offsets = [int(x) for x in args.offsets.split(",") if x]
    subsamples = [int(x) for x in args.subsample.split(",") if x]
    budgets = [float(x) for x in args.budgets.split(",")]
    sweep = SWEEP if args.sweep == "all" else [] if args.sweep == "none" else [SWEEP[int(i)] for i in args.sweep.split(",")]
    started = dt.datetime.now(dt.timezone.utc)

    cfg = ModelConfig.from_hf(json.loads((model_dir("longgen") / "config.json").read_text()))
    import torch     # the model's inv_freq as it computes it (fp32), used in fp64 here

    inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))).double().numpy()
    group = cfg.heads // cfg.kv_heads
    heads = dump_qk("longgen", args.prompts, args.seed, spread=True)
    stacked = dump_qk("longgen", args.prompts, args.seed)
    starts, chunks, rest, n = layout(args.prompts, args.seed, args.merge)
    chunk_options = json.loads(args.chunk_options)
    assert n == heads[0].keys.shape[0], (n, heads[0].keys.shape)
    order = np.concatenate([np.arange(a, a + length) for a, _, length in chunks] + [rest])   # the engine's key order
    frames = chunk_frames(heads, stacked, starts, chunks, group, inv_freq, cfg.max_positions)
    print(f"{len(heads)} heads, {n} keys, {len(chunks)} chunks, rest {len(rest)} keys, "
          f"{heads[0].heldout.shape[0]} held-out queries a head", flush=True)

    rest_graphs = {}
    composed_config = COMPOSED if args.repair_rounds is None else BuildConfig(repair_rounds=args.repair_rounds)

    def composed_index(head, built, delta):
        """The composed index at +delta (the rest's graph built here, once a head and offset) and that build's seconds."""
        keys = rotate(head.keys, delta, inv_freq) if delta else head.keys
        t0 = time.perf_counter()
        if (head.layer, head.kv_head, delta) not in rest_graphs:
            train = request_queries(head, n, group)
            train = rotate(train, delta, inv_freq) if delta else train
            rest_graphs[head.layer, head.kv_head, delta] = AttentionIndex.build(keys[rest], train, threads=1).graph
        rest_s = time.perf_counter() - t0
        parts = [c.graphs[head.layer][head.kv_head] for c in built] + [rest_graphs[head.layer, head.kv_head, delta]]
        return AttentionIndex.compose(keys[order], parts, composed_config), rest_s

    def repaired_index(composed, head, delta, subsample=None):
        """``composed`` repaired as ``IndexSet.add`` does (the request's queries of the head; ``subsample``: a seeded
        sample of that many of them), and the repair's seconds."""
        train = request_queries(head, n, group)
        if subsample is not None and subsample < train.shape[0]:
            train = train[np.sort(np.random.default_rng(args.seed).choice(train.shape[0], subsample, replace=False))]
        train = rotate(train, delta, inv_freq) if delta else train
        t0 = time.perf_counter()
        index = composed.repaired(train, threads=1)
        return index, time.perf_counter() - t0

    def per_request_index(head, delta):
        keys = rotate(head.keys, delta, inv_freq) if delta else head.keys
        train = request_queries(head, n, group)
        train = rotate(train, delta, inv_freq) if delta else train
        t0 = time.perf_counter()
        full = AttentionIndex.build(keys, train, threads=1)
        return full, time.perf_counter() - t0

    built, per_graph, base_digest = build_chunks(frames, chunk_options)
    print(f"chunk graphs: {1e3 * per_graph:.2f} ms a graph, one thread", flush=True)
    curves, builds, same = {}, [], {}
    first_ids = {}
    subsampled = {m: [] for m in subsamples}
    for delta in [0, *offsets]:
        per = {"composed": [], "repaired": [], "per_request": []}
        for head in heads:
            composed, rest_s = composed_index(head, built, delta)
            repaired, repair_s = repaired_index(composed, head, delta)
            full, full_s = per_request_index(head, delta)
            queries = rotate(head.heldout, delta, inv_freq) if delta else head.heldout
            kth = kth_scores(full.keys, queries, args.k)
            ids = {}
            for name, index in (("composed", composed), ("repaired", repaired), ("per_request", full)):
                rows, ids[name] = curve(index, index.keys, queries, kth, args.k, beams)
                per[name].append(rows)
            if delta == 0:
                first_ids[(head.layer, head.kv_head)] = ids
                g = composed.graph
                builds.append({"layer": head.layer, "kv_head": head.kv_head, "rest_build_s": rest_s,
                               "repair_s": repair_s, "per_request_build_s": full_s,
                               "per_request_edges_per_key": full.num_edges / n,
                               "composed_edges_per_key": g.targets.shape[0] / n, "composed_entries": g.entries.shape[0],
                               "repaired_edges_per_key": repaired.num_edges / n,
                               "per_request_graph_bytes_per_key": (full.nbytes - full.keys.nbytes) / n,
                               "per_request_blob_bytes_per_key": len(full.to_bytes()) / n})
                for m in subsamples:
                    sub, sub_s = repaired_index(composed, head, 0, m)
                    rows = curve(sub, sub.keys, queries, kth, args.k, beams)[0]
                    subsampled[m].append((rows, sub_s, sub.num_edges / n))
                    builds[-1].setdefault("repair_subsample_s", {})[str(m)] = sub_s
                    print(f"  repair from {m} queries: {sub_s:.2f}s, recall "
                          + " ".join(f"{r['recall']:.3f}@{100 * r['scanned']:.1f}%" for r in rows[:3]), flush=True)
            else:
                before = first_ids[(head.layer, head.kv_head)]      # at the largest beam
                for name, now in ids.items():
                    same.setdefault(str(delta), {}).setdefault(name, []).append(float((now == before[name]).mean()))
                builds[heads.index(head)].setdefault("far", {})[str(delta)] = {
                    "rest_build_s": rest_s, "repair_s": repair_s, "per_request_build_s": full_s}
            print(f"+{delta} layer {head.layer} kv {head.kv_head}: " + "  ".join(
                f"{name} " + " ".join(f"{r['recall']:.3f}@{100 * r['scanned']:.1f}%" for r in rows[-1][:3])
                for name, rows in per.items())
                  + f"  rest {rest_s:.2f}s, repair {repair_s:.2f}s, per-request {full_s:.2f}s", flush=True)
        curves[str(delta)] = {name: {"mean": mean_rows(v), "per_head": v, "scanned_at_0.95": reach(v, 0.95),
                                     "scanned_at_0.9": reach(v, 0.9),
                                     "recall_at": {str(x): recall_at(mean_rows(v), x) for x in budgets}}
                              for name, v in per.items()}

    train_queries = int(request_queries(heads[0], n, group).shape[0])
    subsample_out = []
    for m, runs in subsampled.items():
        per_head = [rows for rows, _, _ in runs]
        rows = mean_rows(per_head)
        subsample_out.append({"queries": min(m, train_queries), "repair_s": float(np.mean([s for _, s, _ in runs])),
                              "repaired_edges_per_key": float(np.mean([e for _, _, e in runs])),
                              "recall_at": {str(x): recall_at(rows, x) for x in budgets},
                              "scanned_at_0.95": reach(per_head, 0.95), "mean": rows, "per_head": per_head})

    sweep_out = []
    for options in sweep:
        b, s, digest = (built, per_graph, base_digest) if not options else build_chunks(frames, options)
        per_head = []
        for head in heads:
            composed, _ = composed_index(head, b, 0)     # the rest's graph as above
            kth = kth_scores(head.keys, head.heldout, args.k)
            per_head.append(curve(composed, composed.keys, head.heldout, kth, args.k, beams)[0])
        rows = mean_rows(per_head)
        name = ", ".join(f"{k}={v}" for k, v in options.items()) or "default"
        sweep_out.append({"name": name, "options": options, "seconds_per_graph": s, "graphs_as_default": digest == base_digest,
                          "bytes_per_key": float(np.mean([len(c.to_bytes()) for c in b]) / (b[0].length * len(heads))),
                          "entries": int(sum(c.graphs[0][0].entries.shape[0] for c in b)),
                          "recall_at": {str(x): recall_at(rows, x) for x in budgets}, "scanned_at_0.95": reach(per_head, 0.95),
                          "mean": rows, "per_head": per_head})
        print(f"sweep {name}: {1e3 * s:.2f} ms a graph, recall " + ", ".join(
            f"{v:.3f} at {100 * float(x):.0f}%" if v is not None else f"- at {100 * float(x):.0f}%"
            for x, v in sweep_out[-1]["recall_at"].items()), flush=True)

    chunk_keys = sum(length for _, _, length in chunks)
    doc = {"started_utc": started.isoformat(timespec="seconds"), "commit": commit, "argv": sys.argv[1:],
           "repair_rounds": composed_config.repair_rounds, "merge": args.merge, "chunk_options": chunk_options,
           "device": f"CPU, {len(os.sched_getaffinity(0))} cores", "task": "longgen", "prompts": args.prompts,
           "seed": args.seed, "k": args.k, "num_keys": n, "num_chunks": len(chunks), "rest_keys": int(len(rest)),
           "heads": len(heads), "heldout_queries": int(heads[0].heldout.shape[0]), "offsets": offsets,
           "train_queries_per_request": train_queries, "repair_subsample": subsample_out,
           "chunk": {"seconds_per_graph": per_graph, "seconds_per_1k_keys": per_graph * 1000 / chunks[0][2],
                     "blob_bytes_per_key": float(np.mean([len(c.to_bytes()) for c in built]) / (built[0].length * len(heads))),
                     "graph_bytes_per_key": float(np.mean([c.nbytes for c in built]) / (built[0].length * len(heads))),
                     "keys": chunk_keys},
           "builds": builds, "same_ids_as_offset_0": same, "curves": curves, "sweep": sweep_out,
           "seconds": (dt.datetime.now(dt.timezone.utc) - started).total_seconds()}
    print(f"\nrecall@{args.k}, mean of {len(heads)} heads, {n} keys ({len(chunks)} chunks + {len(rest)} rest); "
          f"CPU {doc['device']}, commit {commit}")
    for delta, c in curves.items():
        for name, v in c.items():
            print(f"+{delta:>6} {name:<12} " + " ".join(f"{r['recall']:.3f}@{100 * r['scanned']:.1f}%" for r in v["mean"])
                  + f"  scanned@0.95 {v['scanned_at_0.95']}  recall at {v['recall_at']}")
    for sub in subsample_out:
        print(f"repaired from {sub['queries']} of {train_queries} queries: repair {sub['repair_s']:.2f} s a head, recall "
              f"at {sub['recall_at']}, scanned@0.95 {sub['scanned_at_0.95']}")
    print("same ids as at +0, min over heads: " + ", ".join(
        f"+{d} {name} {min(v):.5f}" for d, names in same.items() for name, v in names.items()))
    full_s = np.mean([b["per_request_build_s"] for b in builds])
    print(f"builds, one thread: chunk {1e3 * per_graph:.2f} ms a graph ({doc['chunk']['seconds_per_1k_keys']:.3f} s / 1K"
          f" keys); per-request {full_s:.2f} s a graph ({full_s / n * 1000:.3f} s / 1K keys); rest "
          f"{np.mean([b['rest_build_s'] for b in builds]):.3f} s; repair {np.mean([b['repair_s'] for b in builds]):.3f}"
          f" s a head; {doc['seconds']:.0f} s in all")
    stem = Path(args.out) / f"{started:%Y-%m-%d}_cpu_{commit}_{args.what}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
