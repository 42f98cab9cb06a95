"""Quest's kernels alone (GPU), the kernels of an older commit beside the current ones, on random data of the
Llama-3-8B shape (8 KV heads, 32 query heads, head dim 128, block size 16, bf16): no model, no engine.

Per (context, batch): a pool of the layer's K/V, each sequence (context - 128) // 512 chunks of 32 pages at their
chunk's offset, a 4-page suffix and the page of its newest token, on random block ids; q random. Timed as replayed
CUDA graphs (graph_ms, bench/decode/sparse.py), ms per replay:

- the peer: dense paged decode of the same table (its split count), and the same with its parts merged by the loop
  it used before their merge took every part at once (``dense_loop_merge_ms``);
- page bounds: a decode step's (each sequence's newest block and a scratch row, as QuestStep.touched) and a
  sequence's chunk blocks (what a fresh context costs a layer), the old torch ops against bound_pages;
- per budget: scores, selection, sparse attention and the three together (one layer's Quest), old against new;
  the new kernels with the tables as the decode graphs hold them (int64 ids and offsets), the old with int32 ones
  (their own casts left out: kernel time only, as bench/decode/sparse.py timed them);
- --sweep: the new kernels' launch configurations (scores tile / heads / warps / one query a program, selection
  radix bits / warps, attention lanes / splits / warps / stages);
- --profile: each kernel's GPU time in one layer's Quest (torch.profiler over eager calls), so the launches'
  shares are known;
- --retro: one layer of a RetroAttention step (window 2: a past row a sequence, whose seen pages are the selection of
  another random query, so most of this step's pages are new to it): ``quest_retro_attention``, which reads each
  selected page once for the current and the past rows (its default lanes, and --retro-lanes), against the current
  rows' sparse attention and the older commit's ``retro_attention`` kernel as two launches (what a1a9a8e ran; the
  older commit must have it), each checked against the twin;
- checks on the GPU: the new kernels against their torch twins (bounds exact; scores close; selection: counts
  equal, the selected scores' sums equal; attention's relative error), and the old selection's sums.

    python3 bench/decode/sparse_kernels.py --old DIR --out bench/decode/DATE_DEVICE_COMMIT_sparse_kernels.json

DIR holds kernels/sparse/*.py of the older commit (without --old: `git show` of --old-commit).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decode.sparse import graph_ms  # noqa: E402
from kernels import sparse  # noqa: E402
from kernels.paged_attention._decode import DecodeConfig, pick_splits  # noqa: E402
from kernels.paged_attention._decode import launch as decode_launch  # noqa: E402
from kernels.paged_attention._meta import pack  # noqa: E402
from kernels.rope import rope_inv_freq  # noqa: E402
from kernels.sparse import _attend, _scores, _select, reference  # noqa: E402
from kernels.sparse._attend import AttendConfig  # noqa: E402
from kernels.sparse._scores import ScoresConfig  # noqa: E402

HQ, HKV, D, BS, CHUNK = 32, 8, 128, 16, 512
DEV = "cuda"
SCORES_SWEEP = [ScoresConfig(32, 8, 4), ScoresConfig(32, 8, 4, one_query=False), ScoresConfig(32, 8, 8),
                ScoresConfig(16, 8, 4), ScoresConfig(16, 8, 2), ScoresConfig(64, 8, 8), ScoresConfig(32, 1, 8)]
SELECT_SWEEP = [(5, None), (4, None), (6, None), (7, None), (8, None), (5, 1), (5, 2), (8, 2), (5, 4), (5, 16)]
ATTEND_SWEEP = [AttendConfig(), AttendConfig(num_stages=1), AttendConfig(num_warps=4),
                AttendConfig(programs_per_sm=1), AttendConfig(programs_per_sm=4), AttendConfig(lanes=8)]


def load_old(src: str | None, commit: str):
    """kernels/sparse of an older commit as the package ``sparse_old`` (its own imports redirected to it)."""
    dst = Path(tempfile.mkdtemp()) / "sparse_old"
    dst.mkdir()
    if src:
        files = {f.name: f.read_text() for f in Path(src).glob("*.py")}
    else:
        names = subprocess.run(["git", "ls-tree", "--name-only", commit, "kernels/sparse/"], capture_output=True,
                               text=True, check=True).stdout.split()
        files = {Path(n).name: subprocess.run(["git", "show", f"{commit}:{n}"], capture_output=True, text=True,
                                              check=True).stdout for n in names if n.endswith(".py")}
    for name, text in files.items():
        (dst / name).write_text(text.replace("kernels.sparse", "sparse_old"))
    sys.path.insert(0, str(dst.parent))
    return importlib.import_module("sparse_old.triton")


def kernel_times(fn, reps: int = 20) -> dict[str, float]:
    """ms a call of each kernel ``fn`` launches (its name shortened), from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if total and evt.count >= reps:
            times[evt.key[:60]] = round(total / reps / 1000.0, 5)   # us -> ms
    return times


def make_case(context: int, batch: int, seed: int):
    """The layer's pool, a batch's table (int64 ids / offsets as a decode graph holds them), q."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    chunks = (context - 128) // CHUNK
    pages = chunks * (CHUNK // BS) + 4 + 1                          # chunks, the suffix, the newest token's page
    n_blocks = batch * pages + 2                                     # + a scratch block and a spare
    ids = torch.randperm(n_blocks - 2, generator=g, device=DEV).view(batch, pages)
    offs = torch.zeros(batch, pages, dtype=torch.int64, device=DEV)
    offs[:, :chunks * (CHUNK // BS)] = (torch.arange(chunks * (CHUNK // BS), device=DEV) // (CHUNK // BS)) * CHUNK
    masks = torch.full((batch, pages), (1 << BS) - 1, dtype=torch.int64, device=DEV)
    masks[:, -1] = (1 << 7) - 1                                      # the newest page: 7 tokens written
    k = torch.randn(n_blocks, BS, HKV, D, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(n_blocks, BS, HKV, D, generator=g, device=DEV).to(torch.bfloat16)
    q = torch.randn(batch, HQ, D, generator=g, device=DEV).to(torch.bfloat16)
    cu = (torch.arange(batch + 1, device=DEV) * pages).to(torch.int32)
    return dict(k=k, v=v, q=q, ids=ids.flatten(), offs=offs.flatten(), masks=masks.flatten(), cu=cu, pages=pages,
                chunks=chunks, n_blocks=n_blocks, scratch=n_blocks - 2)


def visible_rows(masks: torch.Tensor) -> torch.Tensor:
    return ((masks[:, None] >> torch.arange(BS, device=masks.device)) & 1).bool()


def bounds_rows(c, out: dict) -> None:
    """Page bounds: every block's (the case's kmin / kmax, checked against the twin), a step's, a sequence's chunks."""
    k, n = c["k"], c["n_blocks"]
    kmin = torch.zeros(n, HKV, D, dtype=k.dtype, device=DEV)
    kmax = torch.zeros_like(kmin)
    vis = visible_rows(c["masks"])
    sparse.bound_pages(k, kmin, kmax, c["ids"], vis, backend="triton")
    want_min, want_max = kmin.clone(), kmax.clone()
    reference.bound_pages(k, want_min, want_max, c["ids"], vis)
    out["checks"]["bounds_exact"] = bool(torch.equal(kmin, want_min) and torch.equal(kmax, want_max))
    c["kmin"], c["kmax"] = kmin, kmax
    batch, pages = c["cu"].numel() - 1, c["pages"]
    # a step: each sequence's newest block (7 slots) and as many scratch rows showing nothing (QuestStep.touched)
    step_blocks = torch.cat([c["ids"].view(batch, pages)[:, -1], torch.full((batch,), c["scratch"], device=DEV)])
    step_vis = torch.zeros(2 * batch, BS, dtype=torch.bool, device=DEV)
    step_vis[:batch, :7] = True
    chunk_blocks = c["ids"][:c["chunks"] * (CHUNK // BS)]
    chunk_vis = torch.ones(chunk_blocks.numel(), BS, dtype=torch.bool, device=DEV)
    for name, blocks, v in (("step", step_blocks, step_vis), ("chunks", chunk_blocks, chunk_vis)):
        a_min, a_max, b_min, b_max = kmin.clone(), kmax.clone(), kmin.clone(), kmax.clone()
        out["bounds"][name] = {
            "rows": blocks.numel(),
            "old_torch_ms": graph_ms(lambda: reference.bound_pages(k, a_min, a_max, blocks, v)),
            "new_ms": graph_ms(lambda: sparse.bound_pages(k, b_min, b_max, blocks, v, backend="triton"))}
        out["checks"][f"bounds_{name}_exact"] = bool(torch.equal(a_min, b_min) and torch.equal(a_max, b_max))
    c["step_bound"] = (step_blocks, step_vis)


def selected_sums(sel, count, scores):
    taken = torch.arange(sel.shape[2], device=sel.device) < count[:, :, None]
    vals = scores.double()[sel.clamp_min(0).long(), torch.arange(sel.shape[1], device=sel.device)[None, :, None]]
    return torch.where(taken, vals, 0.0).sum(-1)


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def case_rows(c, old, budgets, sweep: bool, deadline: float, profile: bool = False,
              retro_lanes: list[int] | None = None) -> dict:
    inv = rope_inv_freq(D, 500000.0).to(DEV)
    scale = D ** -0.5
    q, k, v, cu = c["q"], c["k"], c["v"], c["cu"]
    ids, offs, masks = c["ids"], c["offs"], c["masks"]
    ids32, offs32 = ids.to(torch.int32), offs.to(torch.int32)
    batch = cu.numel() - 1
    out = {"entries": ids.numel(), "pages_per_sequence": c["pages"], "bounds": {}, "checks": {}, "budgets": [],
           "sweeps": {}}
    bounds_rows(c, out)
    kmin, kmax = c["kmin"], c["kmax"]
    packed = pack(ids32, offs32, masks, BS, inv, with_table=False)
    splits = pick_splits(DecodeConfig(), batch, HKV, ids.numel(), q.device)
    out["dense_ms"] = graph_ms(lambda: decode_launch(q, k, v, packed, cu, inv, scale, cfg=DecodeConfig(num_splits=splits)))
    out["dense_splits"] = splits
    # the peer's merge as it was before its parts were merged all at once (a loop over the parts past the unrolled
    # 16), for the same-run ratio of that change (bench/decode/README.md)
    import kernels.paged_attention._decode as decode_module
    unroll = decode_module.UNROLL_PARTS
    decode_module.UNROLL_PARTS = 1 << 30
    try:
        out["dense_loop_merge_ms"] = graph_ms(
            lambda: decode_launch(q, k, v, packed, cu, inv, scale, cfg=DecodeConfig(num_splits=splits)))
    finally:
        decode_module.UNROLL_PARTS = unroll
    print(f"  dense {out['dense_ms']:.4f} ms ({splits} splits), with the looped merge {out['dense_loop_merge_ms']:.4f}",
          flush=True)

    def new_scores():
        return sparse.page_scores(q, kmin, kmax, ids, offs, masks, cu, inv, backend="triton")

    def old_scores():
        return old.page_scores(q, kmin, kmax, ids32, offs32, masks, cu, inv)

    scores, scores_old = new_scores(), old_scores()
    want = reference.page_scores(q, kmin, kmax, ids, offs, masks, cu, inv)
    fin = torch.isfinite(want)
    out["checks"]["scores_neginf_equal"] = bool(torch.equal(torch.isneginf(scores), torch.isneginf(want)))
    out["checks"]["scores_max_abs_err"] = float((scores[fin] - want[fin]).abs().max())
    out["checks"]["scores_max_rel_err"] = float(((scores[fin] - want[fin]).abs() / want[fin].abs().clamp_min(1)).max())
    out["checks"]["scores_old_max_abs_diff"] = float((scores_old[fin] - scores[fin]).abs().max())
    scores_ms = {"old": graph_ms(old_scores), "new": graph_ms(new_scores)}
    step_blocks, step_vis = c["step_bound"]
    b_min, b_max = kmin.clone(), kmax.clone()
    for budget in budgets:
        pages = budget // BS
        sel, count = sparse.select_pages(scores, cu, pages, backend="triton")
        want_sel, want_count = reference.select_pages(scores, cu, pages)
        sel_old, count_old = old.select_pages(scores_old, cu, pages)   # its own scores' layout (equal values)
        row = {"budget_tokens": budget, "checks": {
            "select_counts_equal": bool(torch.equal(count, want_count)),
            "select_sums_max_diff": float((selected_sums(sel, count, scores) -
                                           selected_sums(want_sel, want_count, scores)).abs().max()),
            "select_old_sums_max_diff": float((selected_sums(sel, count, scores) -
                                               selected_sums(sel_old, count_old, scores_old)).abs().max())}}
        o, lse = sparse.sparse_decode_attention(q, k, v, ids, offs, masks, sel, count, inv, scale, backend="triton")
        o_want, lse_want = reference.sparse_decode_attention(q, k, v, ids, offs, masks, sel, count, inv, scale)
        o_old, _ = old.sparse_decode_attention(q, k, v, ids32, offs32, masks, sel, count, inv, scale)
        row["checks"]["attend_rel_err"] = rel_err(o, o_want)
        row["checks"]["attend_lse_max_abs_err"] = float((lse - lse_want).abs().max())
        row["checks"]["attend_old_rel_diff"] = rel_err(o, o_old)

        def quest_new():
            s = sparse.page_scores(q, kmin, kmax, ids, offs, masks, cu, inv, backend="triton")
            se, co = sparse.select_pages(s, cu, pages, backend="triton")
            return sparse.sparse_decode_attention(q, k, v, ids, offs, masks, se, co, inv, scale, backend="triton")

        def quest_old():
            s = old.page_scores(q, kmin, kmax, ids32, offs32, masks, cu, inv)
            se, co = old.select_pages(s, cu, pages)
            return old.sparse_decode_attention(q, k, v, ids32, offs32, masks, se, co, inv, scale)

        def bound_new():
            sparse.bound_pages(k, b_min, b_max, step_blocks, step_vis, backend="triton")

        def bound_old():
            reference.bound_pages(k, b_min, b_max, step_blocks, step_vis)

        for label, fns in (("old", (old_scores, lambda: old.select_pages(scores_old, cu, pages),
                                    lambda: old.sparse_decode_attention(q, k, v, ids32, offs32, masks, sel, count, inv,
                                                                        scale), quest_old, bound_old)),
                           ("new", (new_scores, lambda: sparse.select_pages(scores, cu, pages, backend="triton"),
                                    lambda: sparse.sparse_decode_attention(q, k, v, ids, offs, masks, sel, count, inv,
                                                                           scale, backend="triton"),
                                    quest_new, bound_new))):
            f_scores, f_select, f_attend, f_quest, f_bound = fns
            row[label] = {"scores_ms": scores_ms[label], "select_ms": graph_ms(f_select),
                          "attend_ms": graph_ms(f_attend), "quest_ms": graph_ms(f_quest),
                          "quest_and_step_bounds_ms": graph_ms(lambda: (f_bound(), f_quest()))}
        if profile:
            row["new"]["kernels_ms"] = kernel_times(quest_new)
            row["dense_kernels_ms"] = kernel_times(
                lambda: decode_launch(q, k, v, packed, cu, inv, scale, cfg=DecodeConfig(num_splits=splits)))
            print(f"  profile {budget}: quest {row['new']['kernels_ms']} dense {row['dense_kernels_ms']}", flush=True)
        if retro_lanes is not None:
            row["retro"] = retro_rows(c, sel, count, budget, inv, scale, retro_lanes)
        row["quest_speedup"] = row["old"]["quest_ms"] / row["new"]["quest_ms"]
        row["dense_over_quest_old"] = out["dense_ms"] / row["old"]["quest_ms"]
        row["dense_over_quest_new"] = out["dense_ms"] / row["new"]["quest_ms"]
        out["budgets"].append(row)
        print(f"  budget {budget}: dense {out['dense_ms']:.4f} | old quest {row['old']['quest_ms']:.4f} (scores "
              f"{row['old']['scores_ms']:.4f} select {row['old']['select_ms']:.4f} attend {row['old']['attend_ms']:.4f})"
              f" | new quest {row['new']['quest_ms']:.4f} (scores {row['new']['scores_ms']:.4f} select "
              f"{row['new']['select_ms']:.4f} attend {row['new']['attend_ms']:.4f}) | dense/quest "
              f"{row['dense_over_quest_old']:.2f}x -> {row['dense_over_quest_new']:.2f}x | checks {row['checks']}",
              flush=True)
        if sweep and time.monotonic() < deadline:
            sw = out["sweeps"].setdefault(str(budget), {})
            sw["attend"] = []
            for cfg in ATTEND_SWEEP:
                if time.monotonic() > deadline:
                    break
                try:
                    ms = graph_ms(lambda: _attend.launch(q, k, v, ids, offs, masks, sel, count, inv, scale, cfg=cfg))
                    got, _ = _attend.launch(q, k, v, ids, offs, masks, sel, count, inv, scale, cfg=cfg)
                    sw["attend"].append({"cfg": repr(cfg), "ms": ms, "rel_err": rel_err(got, o_want)})
                except Exception as exc:  # a configuration that does not compile: recorded, the others go on
                    sw["attend"].append({"cfg": repr(cfg), "error": repr(exc)[:500]})
            if budget == budgets[len(budgets) // 2]:
                sw["select"] = []
                for bits, warps in SELECT_SWEEP:
                    if time.monotonic() > deadline:
                        break
                    ms = graph_ms(lambda: _select.launch(scores, cu, pages, radix_bits=bits, num_warps=warps))
                    s2, c2 = _select.launch(scores, cu, pages, radix_bits=bits, num_warps=warps)
                    sw["select"].append({"radix_bits": bits, "num_warps": warps, "ms": ms,
                                         "counts_equal": bool(torch.equal(c2, want_count))})
            print(f"  sweeps {budget}: {json.dumps(sw)}", flush=True)
    out["scores_sweep"] = []
    for cfg in SCORES_SWEEP if sweep else []:
        if time.monotonic() > deadline:
            break
        ms = graph_ms(lambda: _scores.launch(q, kmin, kmax, ids, offs, masks, cu, inv, cfg=cfg))
        got = _scores.launch(q, kmin, kmax, ids, offs, masks, cu, inv, cfg=cfg)
        out["scores_sweep"].append({"cfg": repr(cfg), "ms": ms, "max_abs_err": float((got[fin] - want[fin]).abs().max())})
    print(f"  scores sweep: {json.dumps(out['scores_sweep'])}", flush=True)
    print(f"  bounds: {json.dumps(out['bounds'])}; checks {out['checks']}", flush=True)
    return out


def retro_rows(c, sel, count, budget: int, inv, scale, lanes: list[int]) -> dict:
    """One sparse layer of a Retro step (window 2) at this case and budget: two launches against the fused one."""
    from kernels.sparse import _retro
    from kernels.sparse.retro import quest_retro_attention_reference

    retro_attention = importlib.import_module("sparse_old.retro").retro_attention   # the older commit's kernel

    q, k, v, cu, kmin, kmax = c["q"], c["k"], c["v"], c["cu"], c["kmin"], c["kmax"]
    ids, offs, masks = c["ids"], c["offs"], c["masks"]
    batch = cu.numel() - 1
    g = torch.Generator(device=DEV).manual_seed(budget)
    q_past = torch.randn(q.shape, generator=g, device=DEV).to(q.dtype)
    other = sparse.page_scores(torch.randn(q.shape, generator=g, device=DEV).to(q.dtype), kmin, kmax, ids, offs,
                               masks, cu, inv, backend="triton")
    sel_then, _ = sparse.select_pages(other, cu, budget // BS, backend="triton")
    seen = torch.where(sel_then >= 0, sel_then.long() - cu.long()[:-1, None, None], -1)   # within the sequence
    entries = (cu[1:] - cu[:-1]).long() - 1            # the past step's table lacked the newest page
    out_in = torch.randn(q.shape, generator=g, device=DEV).to(q.dtype)
    lse_in = torch.randn(q.shape[:2], generator=g, device=DEV) + 4
    seq_of = torch.arange(batch, device=DEV)
    args = (q, q_past, k, v, ids, offs, masks, sel, count, entries, seen, cu, out_in, lse_in, inv, scale)
    want = quest_retro_attention_reference(*args)
    row = {"new_pages_per_head": float(want[4].float().mean()), "selected_per_head": float(count.float().mean())}

    def two_launches():
        out = sparse.sparse_decode_attention(q, k, v, ids, offs, masks, sel, count, inv, scale, backend="triton")
        return out, retro_attention(q_past, k, v, ids, offs, masks, sel, seq_of, entries, seen, cu, out_in, lse_in,
                                    inv, scale, backend="triton")

    row["quest_attend_ms"] = graph_ms(lambda: sparse.sparse_decode_attention(q, k, v, ids, offs, masks, sel, count,
                                                                             inv, scale, backend="triton"))
    row["two_launches_ms"] = graph_ms(two_launches)
    (o, lse), (o_p, lse_p, cnt) = two_launches()
    row["two_launches_checks"] = {"rel_err": rel_err(o, want[0]), "past_rel_err": rel_err(o_p, want[2]),
                                  "counts_equal": bool(torch.equal(cnt, want[4]))}
    row["fused"] = []
    for n in [0] + lanes:
        cfg = _retro.RetroConfig(lanes=n or None)
        try:
            ms = graph_ms(lambda: _retro.quest_retro_launch(*args, cfg=cfg))
            got = _retro.quest_retro_launch(*args, cfg=cfg)
            row["fused"].append({"lanes": n or "default", "ms": ms, "rel_err": rel_err(got[0], want[0]),
                                 "past_rel_err": rel_err(got[2], want[2]),
                                 "lse_max_abs_err": float((got[3] - want[3]).abs().max()),
                                 "counts_equal": bool(torch.equal(got[4], want[4]))})
        except Exception as exc:  # a configuration that does not compile: recorded, the others go on
            row["fused"].append({"lanes": n or "default", "error": repr(exc)[:500]})
    best = min((f["ms"] for f in row["fused"] if "ms" in f), default=float("nan"))
    print(f"  retro {budget}: quest attention {row['quest_attend_ms']:.4f} ms, + correction in two launches "
          f"{row['two_launches_ms']:.4f}, fused {[(f['lanes'], f.get('ms')) for f in row['fused']]} "
          f"(two / fused {row['two_launches_ms'] / best:.2f}x); new pages a head {row['new_pages_per_head']:.1f} of "
          f"{row['selected_per_head']:.1f}; checks {row['two_launches_checks']} {row['fused']}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="32768:1,32768:4,131072:2", help="context:batch pairs")
    ap.add_argument("--budgets", default="1024,2048,4096")
    ap.add_argument("--old", help="a folder of kernels/sparse/*.py of the older commit")
    ap.add_argument("--old-commit", default="2a071d2")
    ap.add_argument("--sweep", action="store_true", help="also the new kernels' launch configurations")
    ap.add_argument("--seconds", type=float, default=1e9, help="no sweep is started after this many seconds")
    ap.add_argument("--profile", action="store_true", help="each kernel's GPU time in one layer's Quest")
    ap.add_argument("--retro", action="store_true", help="a Retro layer: two launches against the fused kernel")
    ap.add_argument("--retro-lanes", default="2,8", help="the fused kernel's lanes to time besides its default")
    args = ap.parse_args()
    start = time.monotonic()
    old = load_old(args.old, args.old_commit)
    commit = os.environ.get("COMMIT") or os.environ.get("TESSERA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                         text=True).stdout.strip()
    import triton
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "commit": commit, "old_commit": args.old or args.old_commit,
               "command": "python3 " + " ".join(sys.argv),
               "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BS, "dtype": "bf16"},
               "cases": []}
    budgets = [int(b) for b in args.budgets.split(",")]
    for pair in args.cases.split(","):
        context, batch = map(int, pair.split(":"))
        print(f"context {context}, batch {batch}", flush=True)
        label = {"context": context, "batch": batch}
        try:
            c = make_case(context, batch, seed=context + batch)
            lanes = [int(n) for n in args.retro_lanes.split(",") if n] if args.retro else None
            results["cases"].append({**label, **case_rows(c, old, budgets, args.sweep, start + args.seconds,
                                                                args.profile, lanes)})
        except Exception as exc:   # report and go on: one shape failing must not hide the others
            results["cases"].append({**label, "error": repr(exc)[:2000]})
            print(f"  failed: {exc!r}"[:1500], flush=True)
        c = None
        torch.cuda.empty_cache()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
