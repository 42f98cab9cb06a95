"""Recall@k of the attention index against the fraction of keys it scores, beside HNSW and IVF (issue #22).

Data: post-RoPE queries and keys of a quality model (``loadgen/quality/qk_dump.py``), every (layer, KV head),
``--prompts`` held-out prompts pooled (longgen: 787 keys a prompt). Each index is built on the keys; ours also
on the prefill queries (every query head of the group). The searched queries are the answer-position queries
of the same prompts, which no build saw. Truth: exact inner products over the pool; a returned key counts as
a hit when its score reaches the k-th exact score (ties, e.g. the ``<bos>`` key of every prompt, count once
each, whichever copy was returned).

Search times are of one thread (faiss' batch search is held to one OpenMP thread, as ours runs on the
caller's); builds use both cores. Scanned = inner products with keys a search computed: ours counts them itself; faiss' HNSW through
``hnsw_stats.ndis`` (every layer's distance computations); IVF as the keys of the probed lists plus the
``nlist`` centroids scored to pick them. hnswlib (0.8.0 builds here) keeps its distance counter out of
its Python binding, so faiss' HNSW stands for HNSW.

    .venv/bin/python bench/index/recall.py                 # writes bench/index/DATE_cpu_COMMIT_recall.{json,png}
    .venv/bin/python bench/index/recall.py --options '{"repair_rounds": 0}' --what no_repair --skip-peers
    .venv/bin/python bench/index/recall.py --spread --skip-peers --grouped --cold 160 --what grouped

``--grouped``: each GQA group's query heads also searched in one traversal (``AttentionIndex.search_group``), the
queries sampled by position; recall per query head, scanned per query head as the group's keys read over G.
``--cold N``: both ways also timed with the keys out of cache (``cold_times``).
``--compact``: ``ours`` and ``grouped`` traverse the float32 keys (``compact=False``, as every run before the int8
keys); this adds ``ours_int8`` and ``grouped_int8``, the same searches on the int8 keys with the beam rescored
exactly (``services/index/compact.py``, what ``AttentionIndex`` does by default), in the recall table and the cold
times.
"""

from __future__ import annotations

import argparse
import datetime as dt
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadgen.quality.qk_dump import dump_qk          # noqa: E402
from services.index import AttentionIndex            # noqa: E402
from services.index._search import search_batch                # noqa: E402
from services.index._search_group import search_group_batch    # noqa: E402


def recall(keys, queries, ids, kth):
    """Mean tie-aware recall: returned keys whose exact score reaches the k-th best, over k."""
    valid = ids >= 0
    scores = np.einsum("bkd,bd->bk", keys[np.where(valid, ids, 0)], queries)
    hits = ((scores >= kth[:, None] - 1e-4 * np.abs(kth[:, None])) & valid).sum(1)
    return float(np.minimum(hits, ids.shape[1]).mean() / ids.shape[1])


def at_recall(points, target):
    """Scanned fraction where the (recall, scanned) curve first reaches ``target``, interpolated; None if never."""
    points = sorted(points, key=lambda p: p[1])
    if points and points[0][0] >= target:
        return points[0][1]
    for (r0, s0), (r1, s1) in zip(points, points[1:]):
        if r0 < target <= r1:
            return s0 + (s1 - s0) * (target - r0) / (r1 - r0)
    return None


def one_thread_search(index, queries, k):
    """faiss searches a batch on all its OpenMP threads; ours searches on the caller's: time both on one."""
    import faiss

    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        t0 = time.perf_counter()
        _, ids = index.search(queries, k)
        return ids, time.perf_counter() - t0
    finally:
        faiss.omp_set_num_threads(threads)


def run_ours(head, kth, k, beams, options, group=1, index=None, compact=False):
    """Our index (built here unless given) searched a query at a time, on the float32 keys or the int8 ones."""
    t0 = time.perf_counter()
    index = index or AttentionIndex.build(head.keys, head.queries, **options)
    build_s = time.perf_counter() - t0
    index.search(head.heldout[:1], k, compact=compact)            # compiled before the clock runs
    rows = []
    for beam in beams:
        t0 = time.perf_counter()
        ids, scanned = index.search(head.heldout, k, beam=beam, compact=compact)
        seconds = time.perf_counter() - t0
        rows.append({"setting": beam, "recall": recall(head.keys, head.heldout, ids, kth),
                     "scanned": float(scanned.mean() / index.num_keys),
                     "us_per_query": seconds / len(head.heldout) * 1e6,
                     "us_per_group": seconds / len(head.heldout) * group * 1e6})
    return index, {"build_s": build_s, "bytes_per_key": len(index.to_bytes()) / index.num_keys,
                   "edges_per_key": index.num_edges / index.num_keys,
                   "memory_bytes_per_key": {"keys": index.keys.nbytes / index.num_keys,
                                            "int8_keys": index.compact.nbytes / index.num_keys,
                                            "graph": (index.graph.offsets.nbytes + index.graph.targets.nbytes)
                                            / index.num_keys},
                   "rows": rows}


def run_grouped(index, head, kth, k, beams, group, compact=False):
    """The same index searched one traversal a GQA group (``AttentionIndex.search_group``): the heldout rows are the
    group's heads one after another (qk_dump.HeadQK), so position i's group is rows i, Q + i, ... Recall is per query head;
    scanned is the group's keys read over ``group``, per query head as the per-head search counts them."""
    q = np.ascontiguousarray(head.heldout.reshape(group, -1, head.heldout.shape[1]).transpose(1, 0, 2))   # [Q, G, D]
    index.search_group(q[:1], k, compact=compact)            # compiled before the clock runs
    rows = []
    for beam in beams:
        t0 = time.perf_counter()
        ids, scanned = index.search_group(q, k, beam=beam, compact=compact)
        seconds = time.perf_counter() - t0
        flat = np.ascontiguousarray(ids.transpose(1, 0, 2).reshape(-1, k))     # back to the heldout's row order
        rows.append({"setting": beam, "recall": recall(head.keys, head.heldout, flat, kth),
                     "scanned": float(scanned.mean() / group / index.num_keys),
                     "us_per_query": seconds / len(head.heldout) * 1e6,
                     "us_per_group": seconds / q.shape[0] * 1e6})
    return {"rows": rows}


def run_hnsw(head, kth, k, efs, m):
    import faiss

    n, d = head.keys.shape
    index = faiss.IndexHNSWFlat(d, m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 200
    t0 = time.perf_counter()
    index.add(head.keys)
    build_s = time.perf_counter() - t0
    rows = []
    for ef in efs:
        index.hnsw.efSearch = max(ef, k)
        faiss.cvar.hnsw_stats.reset()
        ids, seconds = one_thread_search(index, head.heldout, k)
        us = seconds / len(head.heldout) * 1e6
        rows.append({"setting": ef, "recall": recall(head.keys, head.heldout, ids, kth),
                     "scanned": faiss.cvar.hnsw_stats.ndis / len(head.heldout) / n, "us_per_query": us})
    return {"build_s": build_s, "bytes_per_key": len(faiss.serialize_index(index)) / n, "rows": rows}


def run_ivf(head, kth, k, nprobes, nlist):
    import faiss

    n, d = head.keys.shape
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
    t0 = time.perf_counter()
    index.train(head.keys)
    index.add(head.keys)
    build_s = time.perf_counter() - t0
    sizes = np.array([index.invlists.list_size(i) for i in range(nlist)])
    rows = []
    for nprobe in nprobes:
        index.nprobe = nprobe
        ids, seconds = one_thread_search(index, head.heldout, k)
        us = seconds / len(head.heldout) * 1e6
        _, probed = quantizer.search(head.heldout, nprobe)
        scanned = (sizes[probed].sum(1) + nlist).mean() / n
        rows.append({"setting": nprobe, "recall": recall(head.keys, head.heldout, ids, kth),
                     "scanned": float(scanned), "us_per_query": us})
    return {"build_s": build_s, "bytes_per_key": len(faiss.serialize_index(index)) / n, "rows": rows}


def cold_times(index, head, k, beams, group, copies, compact=False, reps=3):
    """Search time a group with the keys coming from memory, not cache: ``copies`` copies of the index (keys, their
    int8 form and graph, over the machine's last-level cache together), position i's group searching copy i % copies.
    Per head, the group's G queries search one after another on their copy (as ``IndexSet`` does a pair's query heads
    on one thread: the later heads find the keys the first read still cached); grouped, one traversal. ``compact``:
    both ways again on the int8 keys (``_int8``), the beam rescored with the float32 keys. Per beam and way: us a group
    and ns a key read, the best of ``reps`` passes (the ways interleaved)."""
    q = np.ascontiguousarray(head.heldout.reshape(group, -1, head.heldout.shape[1]).transpose(1, 0, 2))   # [Q, G, D]
    g = index.graph
    made = [(np.array(index.keys), np.array(index.compact.codes), index.compact.step.copy(), g.offsets.copy(),
             g.targets.copy(), g.entries.copy()) for _ in range(copies)]
    ones = np.ones(index.dim, np.float32)
    ids, scores, scanned = np.empty((group, k), np.int64), np.empty((group, k), np.float32), np.empty(group, np.int64)
    gids, gscores, gscanned = ids[None], scores[None], np.empty(1, np.int64)

    def args(copy, int8):
        keys, codes, step, offsets, targets, entries = copy
        return (codes, step, keys) if int8 else (keys, ones, keys), (offsets, targets, entries)

    def per_head(beam, int8=False):
        read = 0
        for i in range(q.shape[0]):
            nav, graph = args(made[i % copies], int8)
            search_batch(*nav, *graph, q[i], beam, k, not int8, ids, scores, scanned)
            read += int(scanned.sum())
        return read

    def grouped(beam, int8=False):
        read = 0
        for i in range(q.shape[0]):
            nav, graph = args(made[i % copies], int8)
            search_group_batch(*nav, *graph, q[i:i + 1], beam, k, not int8, gids, gscores, gscanned)
            read += int(gscanned[0])
        return read

    ways = {"per_head": per_head, "grouped": grouped}
    if compact:
        ways |= {"per_head_int8": lambda beam: per_head(beam, True), "grouped_int8": lambda beam: grouped(beam, True)}
    for fn in ways.values():
        fn(k)                                   # compiled for the copies' (writable) arrays
    out = []
    for beam in beams:
        best = {w: np.inf for w in ways}
        read = {}
        for _ in range(reps):
            for w, fn in ways.items():
                t0 = time.perf_counter()
                read[w] = fn(beam)
                best[w] = min(best[w], time.perf_counter() - t0)
        out.append({"setting": beam, **{w: {"us_per_group": best[w] / q.shape[0] * 1e6,
                                            "ns_per_key": best[w] / read[w] * 1e9} for w in ways}})
    return {"copies": copies, "bytes": sum(sum(a.nbytes for a in c) for c in made), "reps": reps, "rows": out}


COLD_METHOD = {"per_head": "ours", "grouped": "grouped", "per_head_int8": "ours_int8", "grouped_int8": "grouped_int8"}


def time_at_recall(results, targets=(0.95, 0.98)):
    """Per method: us a group at equal recall, interpolated on each head's (recall, us) curve, then the mean over
    heads; cached (the recall run's times) and, where timed, cold (``cold_times``)."""
    out = {}
    for method in results[0]["methods"]:
        if "us_per_group" not in results[0]["methods"][method]["rows"][0]:
            continue
        cold_way = next((w for w, m in COLD_METHOD.items() if m == method), None)
        entry = {}
        for target in targets:
            cached, cold = [], []
            for r in results:
                rows = r["methods"][method]["rows"]
                cached.append(at_recall([(x["recall"], x["us_per_group"]) for x in rows], target))
                if "cold" in r and cold_way in r["cold"]["rows"][0]:
                    cold.append(at_recall([(x["recall"], c[cold_way]["us_per_group"])
                                           for x, c in zip(rows, r["cold"]["rows"])], target))
            entry[str(target)] = {"cached_us": float(np.mean(cached)) if None not in cached else None,
                                  "cold_us": float(np.mean(cold)) if cold and None not in cold else None}
        out[method] = entry
    return out


def summarize(results, k):
    """Per method and setting: recall and scanned averaged over heads; per method: scanned at recall 0.9/0.95."""
    out = {}
    for method in results[0]["methods"]:
        per = [r["methods"][method] for r in results]
        rows = [{"setting": row["setting"],
                 "recall": float(np.mean([p["rows"][i]["recall"] for p in per])),
                 "scanned": float(np.mean([p["rows"][i]["scanned"] for p in per])),
                 "us_per_query": float(np.mean([p["rows"][i]["us_per_query"] for p in per])),
                 **({"us_per_group": float(np.mean([p["rows"][i]["us_per_group"] for p in per]))}
                    if "us_per_group" in row else {})}
                for i, row in enumerate(per[0]["rows"])]
        reach = {}
        for target in (0.9, 0.95, 0.98):
            each = [at_recall([(x["recall"], x["scanned"]) for x in p["rows"]], target) for p in per]
            reach[str(target)] = {"mean": float(np.mean(each)) if None not in each else None,
                                  "max": max(each) if None not in each else None, "per_head": each}
        out[method] = {"rows": rows, "scanned_at_recall": reach}
        if "build_s" in per[0]:
            out[method]["build_s_per_1k_keys"] = float(np.mean([p["build_s"] / results[0]["num_keys"] * 1000
                                                                for p in per]))
            out[method]["bytes_per_key"] = float(np.mean([p["bytes_per_key"] for p in per]))
    return out


def plot(results, summary, k, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    colors = {"ours": "tab:red", "hnsw": "tab:blue", "ivf": "tab:green", "grouped": "tab:orange",
              "ours_int8": "tab:purple", "grouped_int8": "tab:brown"}
    for method, s in summary.items():
        axes[0].plot([100 * r["scanned"] for r in s["rows"]], [r["recall"] for r in s["rows"]], marker="o",
                     color=colors.get(method), label=f"{method} (mean of {len(results)} heads)")
        for r in results:
            rows = r["methods"][method]["rows"]
            axes[1].plot([100 * x["scanned"] for x in rows], [x["recall"] for x in rows], color=colors.get(method),
                         alpha=0.5, linewidth=1, label=method if r is results[0] else None)
    ticks = [0.5, 1, 2, 3, 5, 10, 20, 30, 50, 100]
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("keys scanned (% of the head's keys)")
        ax.set_ylabel(f"recall@{k}")
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=0.8)
        ax.axvline(3, color="grey", linestyle=":", linewidth=0.8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_title("mean over (layer, KV head)", fontsize=9)
    axes[1].set_title("each (layer, KV head)", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _title(doc: dict) -> str:
    heads = doc["heads"]
    layout = ", spread" if doc.get("spread") else ""
    return (f"{doc['task']} model ({doc['prompts']} prompts{layout}), {len(heads)} (layer, KV head) x "
            f"{heads[0]['num_keys']} keys, {heads[0]['heldout_queries']} held-out answer-position queries each; "
            f"CPU, commit {doc['commit']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="longgen", choices=("longgen", "coref"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spread", action="store_true",
                    help="each prompt rotated on to its own offset in the pool (qk_dump.dump_qk's spread)")
    ap.add_argument("-k", type=int, default=100)
    ap.add_argument("--beams", default="100,128,160,200,260,350,500")
    ap.add_argument("--ef", default="100,128,160,200,260,350,500,800,1200")
    ap.add_argument("--hnsw-m", type=int, default=16)
    ap.add_argument("--nlist", type=int, default=256)
    ap.add_argument("--nprobe", default="2,4,8,16,32,64,128")
    ap.add_argument("--options", default="{}", help="AttentionIndex.build options as JSON")
    ap.add_argument("--heads", default="", help="only these (layer:kv_head,...), e.g. 3:1,0:0")
    ap.add_argument("--skip-peers", action="store_true", help="ours only")
    ap.add_argument("--queries", type=int, default=0,
                    help="search a seeded sample of this many of a head's held-out queries (0: all of them)")
    ap.add_argument("--grouped", action="store_true",
                    help="also search each GQA group's query heads in one traversal (AttentionIndex.search_group); "
                         "the queries sampled by position (every head of one)")
    ap.add_argument("--cold", type=int, default=0, metavar="COPIES",
                    help="with --grouped: also time both ways with the keys out of cache, over this many copies of "
                         "each index (per head and grouped, one thread)")
    ap.add_argument("--compact", action="store_true",
                    help="also search on the int8 keys, the beam rescored exactly (ours_int8, grouped_int8)")
    ap.add_argument("--what", default="recall", help="the output files' last name part")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG beside a run's JSON")
    args = ap.parse_args()
    if args.replot:
        doc = json.loads(Path(args.replot).read_text())
        plot(doc["heads"], doc["summary"], doc["k"], Path(args.replot).with_suffix(".png"), _title(doc))
        return

    commit = os.environ.get("COMMIT") or os.environ.get("TESSERA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True, check=True).stdout.strip()
    import faiss

    beams, efs, nprobes = ([int(x) for x in s.split(",")] for s in (args.beams, args.ef, args.nprobe))
    options = json.loads(args.options)
    started = dt.datetime.now(dt.timezone.utc)
    heads = dump_qk(args.task, args.prompts, args.seed, spread=args.spread)
    if args.heads:
        wanted = {tuple(int(x) for x in pair.split(":")) for pair in args.heads.split(",")}
        heads = [h for h in heads if (h.layer, h.kv_head) in wanted]
    results = []
    group = heads[0].queries.shape[0] // heads[0].keys.shape[0]      # query heads a KV head (qk_dump.HeadQK)
    for head in heads:
        if args.grouped and args.queries and head.heldout.shape[0] > args.queries:    # whole groups: positions
            per = head.heldout.reshape(group, -1, head.heldout.shape[1])
            pick = np.sort(np.random.default_rng(args.seed).choice(per.shape[1], args.queries // group, replace=False))
            head = dataclasses.replace(head, heldout=np.ascontiguousarray(per[:, pick].reshape(-1, per.shape[2])))
        elif args.queries and head.heldout.shape[0] > args.queries:
            pick = np.sort(np.random.default_rng(args.seed).choice(head.heldout.shape[0], args.queries, replace=False))
            head = dataclasses.replace(head, heldout=np.ascontiguousarray(head.heldout[pick]))
        flat = faiss.IndexFlatIP(head.keys.shape[1])
        flat.add(head.keys)
        kth = flat.search(head.heldout, args.k)[0][:, -1]
        index, ours = run_ours(head, kth, args.k, beams, options, group)
        methods = {"ours": ours}
        if args.compact:
            methods["ours_int8"] = run_ours(head, kth, args.k, beams, options, group, index, compact=True)[1]
        if args.grouped:
            methods["grouped"] = run_grouped(index, head, kth, args.k, beams, group)
            if args.compact:
                methods["grouped_int8"] = run_grouped(index, head, kth, args.k, beams, group, compact=True)
        if not args.skip_peers:
            methods["hnsw"] = run_hnsw(head, kth, args.k, efs, args.hnsw_m)
            methods["ivf"] = run_ivf(head, kth, args.k, nprobes, args.nlist)
        results.append({"layer": head.layer, "kv_head": head.kv_head, "num_keys": int(head.keys.shape[0]),
                        "train_queries": int(head.queries.shape[0]), "heldout_queries": int(head.heldout.shape[0]),
                        "methods": methods})
        if args.grouped and args.cold:
            results[-1]["cold"] = cold_times(index, head, args.k, beams, group, args.cold, args.compact)
            print("  cold, us a group (ns a key read): " + "  ".join(
                f"beam {r['setting']}: " + ", ".join(f"{w} {v['us_per_group']:.0f} ({v['ns_per_key']:.0f})"
                                                     for w, v in r.items() if w != "setting")
                for r in results[-1]["cold"]["rows"]), flush=True)
        line = "  ".join(f"{m} " + " ".join(f"{r['recall']:.3f}@{100 * r['scanned']:.1f}%" for r in v["rows"][:3])
                         for m, v in methods.items())
        print(f"layer {head.layer} kv head {head.kv_head} (N={head.keys.shape[0]}): {line}", flush=True)

    summary = summarize(results, args.k)
    n = results[0]["num_keys"]
    print(f"\nrecall@{args.k} and keys scanned, mean over {len(results)} (layer, KV head) of {n} keys each "
          f"({args.task}, {args.prompts} prompts{', spread' if args.spread else ''}); CPU, {len(os.sched_getaffinity(0))} cores, commit {commit}")
    print(f"{'method':<14} {'setting':>8} {'recall':>7} {'scanned':>8} {'keys':>6} {'us/query':>9} {'us/group':>9}")
    for method, s in summary.items():
        for r in s["rows"]:
            per_group = f"{r['us_per_group']:9.1f}" if "us_per_group" in r else ""
            print(f"{method:<14} {r['setting']:>8} {r['recall']:7.3f} {100 * r['scanned']:7.2f}% "
                  f"{r['scanned'] * n:6.0f} {r['us_per_query']:9.1f} {per_group}")
    print(f"\n{'method':<6} {'scanned@0.90':>13} {'scanned@0.95 (mean / worst head)':>34} {'build s/1K keys':>16} "
          f"{'bytes/key':>10}")
    for method, s in summary.items():
        def pct(x):
            return "never" if x is None else f"{100 * x:.2f}%"
        r90, r95 = s["scanned_at_recall"]["0.9"], s["scanned_at_recall"]["0.95"]
        build = f"{s['build_s_per_1k_keys']:16.3f} {s['bytes_per_key']:10.0f}" if "bytes_per_key" in s else ""
        print(f"{method:<14} {pct(r90['mean']):>13} {pct(r95['mean']) + ' / ' + pct(r95['max']):>34} {build}")

    cold = None
    if "cold" in results[0]:
        rows = [r["cold"]["rows"] for r in results]
        cold = [{"setting": row["setting"], **{w: {x: float(np.mean([hr[i][w][x] for hr in rows]))
                                                   for x in ("us_per_group", "ns_per_key")}
                                               for w in row if w != "setting"}} for i, row in enumerate(rows[0])]
        print(f"\nkeys out of cache ({results[0]['cold']['copies']} copies of each index), one thread, mean over "
              f"heads: us a group (ns a key read)")
        for row in cold:
            print(f"beam {row['setting']:>5}: " + "  ".join(f"{w} {v['us_per_group']:.0f} ({v['ns_per_key']:.0f})"
                                                          for w, v in row.items() if w != "setting"))
    at_equal = time_at_recall(results)
    if at_equal:
        print("\nus a group at equal recall (each head's curve interpolated, mean over heads): cached / cold")
        for method, entry in at_equal.items():
            print(f"{method:<14} " + "  ".join(
                f"{t}: {'-' if v['cached_us'] is None else round(v['cached_us'])} / "
                f"{'-' if v['cold_us'] is None else round(v['cold_us'])}" for t, v in entry.items()))

    stem = Path(args.out) / f"{started:%Y-%m-%d}_cpu_{commit}_{args.what}"
    doc = {"started_utc": started.isoformat(timespec="seconds"), "commit": commit, "argv": sys.argv[1:],
           "device": f"CPU, {len(os.sched_getaffinity(0))} cores", "task": args.task, "prompts": args.prompts, "spread": args.spread,
           "seed": args.seed, "k": args.k, "options": options, "hnsw_m": args.hnsw_m, "nlist": args.nlist,
           "queries_sampled": args.queries or None, "group": group, "grouped": args.grouped,
           "seconds": (dt.datetime.now(dt.timezone.utc) - started).total_seconds(), "summary": summary,
           "cold_summary": cold, "us_per_group_at_recall": at_equal,
           "heads": results}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, summary, args.k, stem.with_suffix(".png"), _title(doc))
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
