"""Kernel benchmarks (issue #3): deferred-RoPE paged attention vs torch SDPA, on one GPU.

    python bench/kernels/kernels.py --out /tmp/bench        # on the GPU machine; writes kernels.json there
    python bench/kernels/kernels.py --sweep --out /tmp/bench  # also each prefill variant without rotation
    python bench/kernels/kernels.py --rotation --out /tmp/bench  # only the query-rotation variants, interleaved
    python bench/kernels/kernels.py --compile-only          # no GPU: every prefill variant compiled for sm_90
    TRITON_INTERPRET=1 python bench/kernels/kernels.py --smoke   # tiny shapes on the CPU: checks the script only

Order: ceilings (copy bandwidth, bf16 matmul), correctness on the GPU (Triton vs twin on mixed small
cases, then every timed scenario vs its SDPA peer), then timings (medians of do_bench) of prefill,
decode and RoPE with every variant beside its peer. Llama-3-8B heads: 32 query, 8 KV, d=128, bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "kernels")]

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.paged_attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from kernels.paged_attention import _decode, _meta, _prefill  # noqa: E402
from kernels.paged_attention._meta import pack  # noqa: E402
from kernels.paged_attention._prefill_query import ROT_MODES  # noqa: E402
from kernels.rope import apply_rope, rope_inv_freq, rotate, rope_cos_sin  # noqa: E402

HQ, HKV, D = 32, 8, 128
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
LOG: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def timeit(fn, reps: int = 200) -> float:
    """Median milliseconds (CUDA events through do_bench; a wall clock on the CPU smoke run)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float("inf") if torch.isnan(a).any() else float((a - b).norm() / b.norm().clamp_min(1e-30))


def ceilings(dev) -> dict:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = timeit(lambda: y.copy_(x), 50)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm = timeit(lambda: a @ a, 50)
    del x, y, a
    return {"copy_TBps": 2 * (1 << 30) / ms / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm / 1e9}


def paged(n_seqs: int, ctx: int, chunk: int, suffix: int, bs: int, dev, dtype=torch.bfloat16, seed: int = 0):
    """n_seqs sequences of `ctx` cached tokens in chunks of `chunk` (keys at chunk-local positions,
    offset = chunk start) plus `suffix` private tokens (global positions, offset 0), on shuffled blocks.
    Returns the block table and, per sequence, the same keys rotated eagerly and laid out contiguously."""
    g = torch.Generator(device=dev).manual_seed(seed)
    per = (ctx + suffix) // bs
    n = n_seqs * per
    k_cache = torch.randn((n, bs, HKV, D), device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn((n, bs, HKV, D), device=dev, dtype=dtype, generator=g)
    ids = torch.randperm(n, device=dev, generator=g).to(torch.int32)
    start = torch.arange(per, device=dev).repeat(n_seqs) * bs  # first global position of each entry
    shared = start < ctx
    offsets = torch.where(shared, start // chunk * chunk, 0).to(torch.int32)
    local = torch.where(shared, start - offsets, start)[:, None] + torch.arange(bs, device=dev)
    slot_pos = torch.empty((n, bs), dtype=torch.int32, device=dev)
    slot_pos[ids.long()] = local.to(torch.int32)
    masks = torch.full((n,), (1 << bs) - 1 if bs < 64 else -1, dtype=torch.int64, device=dev)
    cu = (torch.arange(n_seqs + 1, device=dev) * per).to(torch.int32)
    tok_off = offsets.repeat_interleave(bs)
    return dict(k_cache=k_cache, v_cache=v_cache, slot_pos=slot_pos, block_ids=ids, offsets=offsets, masks=masks,
                cu_entries=cu, tok_off=tok_off, n_seqs=n_seqs, tokens=ctx + suffix)


def contiguous_kv(p, inv):
    """Peer layout: keys rotated eagerly to global positions, [B, Hkv, S, D] contiguous."""
    ids = p["block_ids"].long()
    k = p["k_cache"][ids].reshape(-1, HKV, D)
    cos, sin = rope_cos_sin(p["tok_off"].long(), inv)
    k = rotate(k, cos[:, None, :], sin[:, None, :])
    shape = (p["n_seqs"], p["tokens"], HKV, D)
    return (k.reshape(shape).transpose(1, 2).contiguous(),
            p["v_cache"][ids].reshape(shape).transpose(1, 2).contiguous())


def sdpa_peer(q4, k4, v4, lower_right: bool, want):
    """The fastest SDPA call that computes the same attention, flash first.
    Returns (call(k4, v4) -> out [B, Hq, T, D], its name, its error against `want`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    mask = causal_lower_right(q4.shape[2], k4.shape[2]) if lower_right else None
    tries = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        for gqa in (True, False):
            def call(k, v, backend=backend, gqa=gqa):
                if not gqa:  # a backend without GQA gets the KV heads repeated, inside its timing
                    k, v = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
                with sdpa_kernel(backend):
                    return sdpa(q4, k, v, attn_mask=mask, enable_gqa=gqa)
            try:
                err = rel(call(k4, v4), want)
            except RuntimeError as exc:
                tries.append(f"{backend.name}/gqa={gqa}: {str(exc).splitlines()[0][:80]}")
                continue
            if err < 2e-2:
                return call, f"{backend.name}{'+gqa' if gqa else '+expanded heads'}", err
            tries.append(f"{backend.name}/gqa={gqa}: rel err {err:.3g}")
    raise RuntimeError("no SDPA peer matched: " + "; ".join(tries))


def check_small(dev) -> list:
    """Triton vs twin on mixed small cases on the GPU (bf16/fp16, BS 16/32/64, GQA 1/4/8, D 64/128)."""
    from paged_cases import build, prefill_queries

    rows = []
    for dtype, bs, hq, hkv, d in [(torch.bfloat16, 16, 32, 8, 128), (torch.float16, 32, 8, 8, 64),
                                  (torch.bfloat16, 64, 8, 1, 128), (torch.float16, 16, 8, 2, 64)]:
        inv = rope_inv_freq(d, 500000.0, LLAMA3)
        seqs = [([300, 77, 129], 40), ([63], 1), ([1000], 200)]
        case = build(seqs, bs, hkv, d, inv, dtype=dtype, device=dev, hide=0.1, base=60000 if bs == 32 else 0)
        q, q_pos, cu_q = prefill_queries(case, [40, 1, 200], [9, 0, 30], hq, dtype)
        args = (q, q_pos, case.k_cache, case.v_cache, case.slot_pos, case.block_ids, case.offsets, case.masks,
                cu_q, case.cu_entries, case.inv_freq, d ** -0.5)
        (o1, l1), (o2, l2) = (paged_prefill_attention(*args, backend=b) for b in ("torch", "triton"))
        qd = torch.randn(len(seqs), hq, d, device=dev, dtype=dtype)
        dargs = (qd, case.k_cache, case.v_cache, case.block_ids, case.offsets, case.masks, case.cu_entries,
                 case.inv_freq, d ** -0.5)
        (o3, l3), (o4, l4) = (paged_decode_attention(*dargs, backend=b) for b in ("torch", "triton"))
        row = {"case": f"B3-BS{bs}-H{hq}x{hkv}-D{d}-{str(dtype)[6:]}", "prefill_rel": rel(o2, o1),
               "prefill_lse_abs": float((l2 - l1).abs().nan_to_num(0).max()), "decode_rel": rel(o4, o3),
               "decode_lse_abs": float((l4 - l3).abs().nan_to_num(0).max())}
        row["ok"] = row["prefill_rel"] < 2e-2 and row["decode_rel"] < 2e-2 and row["prefill_lse_abs"] < 0.1
        rows.append(row)
        say(f"check {row['case']}: prefill rel {row['prefill_rel']:.2e}, decode rel {row['decode_rel']:.2e}"
            f" {'ok' if row['ok'] else 'FAILED'}")
    return rows


def check_variants(dev, cfgs) -> list:
    """Each prefill variant against the twin on check_small's first case (the benchmark's heads, bf16,
    block size 16, three sequences, hidden slots), its KV split in 3 so that some offset groups lie
    outside a split's entries (they loop zero times)."""
    from paged_cases import build, prefill_queries

    inv = rope_inv_freq(D, 500000.0, LLAMA3)
    case = build([([300, 77, 129], 40), ([63], 1), ([1000], 200)], 16, HKV, D, inv, dtype=torch.bfloat16,
                 device=dev, hide=0.1)
    q, q_pos, cu_q = prefill_queries(case, [40, 1, 200], [9, 0, 30], HQ, torch.bfloat16)
    kv = (case.k_cache, case.v_cache, case.slot_pos)
    want, _ = paged_prefill_attention(q, q_pos, *kv, case.block_ids, case.offsets, case.masks, cu_q, case.cu_entries,
                                      case.inv_freq, D ** -0.5, backend="torch")
    packed = pack(case.block_ids, case.offsets, case.masks, 16, case.inv_freq, with_table=True,
                  cu_entries=case.cu_entries)
    rows = []
    for c in cfgs:
        out, _ = _prefill.launch(q, q_pos, *kv, packed, cu_q, case.inv_freq, D ** -0.5,
                                 cfg=dataclasses.replace(c, num_splits=3))
        rows.append({"variant": cfg_name(c), "rel_vs_twin": rel(out, want), "ok": rel(out, want) < 2e-2})
        say(f"check {rows[-1]['variant']} (3 splits): rel vs twin {rows[-1]['rel_vs_twin']:.2e}"
            f" {'ok' if rows[-1]['ok'] else 'FAILED'}")
    return rows


PC, DC = _prefill.PrefillConfig, _decode.DecodeConfig
# the default first; --sweep times each with and without rotation
# the ways of rotating the query per offset group (PrefillConfig.rot_mode / rot_narrow) at the default tile, the
# default first: --rotation times only these, interleaved. (Default since the interleaved --rotation run of
# 2026-11-22, bench/kernels/README.md: prefetch_cs without the per-group guard; the modes and the guard that lost
# there were removed with their code, their figures in that README.)
ROTATION_CONFIGS = [PC()] + [PC(rot_mode=m, rot_narrow=n) for m in ROT_MODES for n in (False, True)
                             if (m, n) != (PC().rot_mode, PC().rot_narrow)]
PREFILL_CONFIGS = [PC(), PC(num_stages=3), PC(128, 64, 8, 2), PC(128, 64, 8, 3), PC(64, 32, 4, 3),
                   *ROTATION_CONFIGS[1:]]


def cfg_name(c) -> str:
    mode = "" if c.rot_mode == PC().rot_mode else f"/{c.rot_mode}"
    mode += "/narrow" if c.rot_narrow else ""
    return f"{c.block_m}x{c.min_block_n}/w{c.num_warps}/s{c.num_stages}/split{c.num_splits}{mode}"
DECODE_CONFIGS = [DC(), DC(num_stages=2), DC(num_stages=4)] + [DC(num_splits=s) for s in (2, 4, 5, 8, 12)]


def bench_prefill(ctx: int, new: int, bs: int, dev, inv, smoke: bool, sweep: bool = False) -> dict:
    chunk = ctx // 8  # >= 8 chunks
    p = paged(1, ctx, chunk, new, bs, dev)
    q = torch.randn((new, HQ, D), device=dev, dtype=torch.bfloat16)
    q_pos = torch.arange(ctx, ctx + new, device=dev, dtype=torch.int32)
    cu_q = torch.tensor([0, new], device=dev, dtype=torch.int32)
    scale = D ** -0.5
    flops = 4 * D * HQ * (new * ctx + new * (new + 1) / 2)
    tf = lambda ms: flops / ms / 1e9  # noqa: E731
    args = (q, q_pos, p["k_cache"], p["v_cache"], p["slot_pos"])
    tabled = pack(p["block_ids"], p["offsets"], p["masks"], bs, inv, with_table=True, cu_entries=p["cu_entries"])
    plain = pack(p["block_ids"], p["offsets"], p["masks"], bs, inv, with_table=False, cu_entries=p["cu_entries"])
    run = lambda packed, rotate=True, cfg=_prefill.PrefillConfig(): _prefill.launch(  # noqa: E731
        *args, packed, cu_q, inv, scale, rotate=rotate, cfg=cfg)
    res = {"ctx": ctx, "new": new, "chunks": ctx // chunk, "block_size": bs, "flops": flops}

    out, _ = run(tabled)
    k4, v4 = contiguous_kv(p, inv)
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, T, D]
    call, res["sdpa_backend"], res["triton_vs_sdpa_rel"] = sdpa_peer(q4, k4, v4, True, out.transpose(0, 1).unsqueeze(0))
    res["computed_vs_table_rel"] = rel(run(plain)[0], out)
    say(f"prefill ctx={ctx}: triton vs SDPA ({res['sdpa_backend']}) rel err {res['triton_vs_sdpa_rel']:.2e}")

    ids = p["block_ids"].long()
    tok_off = p["tok_off"]
    def rotate_and_copy():
        k = apply_rope(p["k_cache"][ids].reshape(-1, HKV, D), tok_off, inv, backend="triton")
        return k, p["v_cache"][ids].reshape(-1, HKV, D)

    def sdpa_after_rotate():
        k, v = rotate_and_copy()
        return call(k.view(1, -1, HKV, D).transpose(1, 2), v.view(1, -1, HKV, D).transpose(1, 2))

    res["sdpa_ms"] = timeit(lambda: call(k4, v4))
    res["rotate_copy_ms"] = timeit(rotate_and_copy)
    res["sdpa_plus_rotate_ms"] = timeit(sdpa_after_rotate)
    cfgs = PREFILL_CONFIGS[:2] if smoke else PREFILL_CONFIGS
    res["configs"] = {}
    for c in cfgs:  # each variant checked against the default's output, then timed (cos/sin table)
        row = {"rel_vs_default": rel(run(tabled, cfg=c)[0], out), "ms": timeit(lambda c=c: run(tabled, cfg=c))}
        if sweep:
            row["no_rot_ms"] = timeit(lambda c=c: run(tabled, rotate=False, cfg=c))
            row["rot_overhead"] = row["ms"] / row["no_rot_ms"] - 1
        row["TFLOPs"] = tf(row["ms"])
        res["configs"][cfg_name(c)] = row
        say(f"  {cfg_name(c)}: {json.dumps(row)}")
    best_name = min(res["configs"], key=lambda k: res["configs"][k]["ms"])
    best = cfgs[list(res["configs"]).index(best_name)]
    res["best_config"] = best_name
    # rotation on/off and table/computed, interleaved twice at the best config: spread = noise
    for rep in (1, 2):
        res[f"rot_computed_ms_{rep}"] = timeit(lambda: run(plain, cfg=best))
        res[f"rot_table_ms_{rep}"] = timeit(lambda: run(tabled, cfg=best))
        res[f"no_rot_ms_{rep}"] = timeit(lambda: run(plain, rotate=False, cfg=best))
    public = lambda: paged_prefill_attention(  # noqa: E731
        *args, p["block_ids"], p["offsets"], p["masks"], cu_q, p["cu_entries"], inv, scale, backend="triton")
    res["public_call_ms"] = timeit(public)  # the table packed once, as for every layer after the first
    res["public_call_first_ms"] = timeit(lambda: (_meta._CACHE.clear(), public()))  # validate + pack each time
    for key in ("sdpa", "sdpa_plus_rotate", "rot_table", "rot_computed", "no_rot", "public_call", "public_call_first"):
        ms = res[f"{key}_ms"] if f"{key}_ms" in res else (res[f"{key}_ms_1"] + res[f"{key}_ms_2"]) / 2
        res[f"{key}_TFLOPs"] = tf(ms)
    return res


def bench_rotation(ctx: int, new: int, bs: int, dev, inv, reps: int, smoke: bool) -> dict:
    """Every ROTATION_CONFIGS variant with and without rotation, and SDPA, interleaved in `reps`
    rounds at one prefill size (the --sweep's scenario): medians per variant, and every round's
    time, whose spread is the noise the overhead is read against."""
    p = paged(1, ctx, ctx // 8, new, bs, dev)
    q = torch.randn((new, HQ, D), device=dev, dtype=torch.bfloat16)
    q_pos = torch.arange(ctx, ctx + new, device=dev, dtype=torch.int32)
    cu_q = torch.tensor([0, new], device=dev, dtype=torch.int32)
    flops = 4 * D * HQ * (new * ctx + new * (new + 1) / 2)
    tabled = pack(p["block_ids"], p["offsets"], p["masks"], bs, inv, with_table=True, cu_entries=p["cu_entries"])
    run = lambda cfg, rotate=True: _prefill.launch(  # noqa: E731
        q, q_pos, p["k_cache"], p["v_cache"], p["slot_pos"], tabled, cu_q, inv, D ** -0.5, rotate=rotate, cfg=cfg)
    want = run(PC())[0]
    k4, v4 = contiguous_kv(p, inv)
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, T, D]
    call, backend, err = sdpa_peer(q4, k4, v4, True, want.transpose(0, 1).unsqueeze(0))
    cfgs = ROTATION_CONFIGS[:2] if smoke else ROTATION_CONFIGS
    rows = {cfg_name(c): {"rel_vs_default": rel(run(c)[0], want), "rot_ms": [], "no_rot_ms": []} for c in cfgs}
    sdpa_ms = []
    for _ in range(reps):
        sdpa_ms.append(timeit(lambda: call(k4, v4)))
        for c, row in zip(cfgs, rows.values()):
            row["rot_ms"].append(timeit(lambda c=c: run(c)))
            row["no_rot_ms"].append(timeit(lambda c=c: run(c, False)))
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    res = {"ctx": ctx, "new": new, "flops": flops, "sdpa_backend": backend, "triton_vs_sdpa_rel": err,
           "sdpa_ms": sdpa_ms, "sdpa_TFLOPs": flops / median(sdpa_ms) / 1e9, "variants": rows}
    for name, row in rows.items():
        rot, no_rot = median(row["rot_ms"]), median(row["no_rot_ms"])
        row |= {"TFLOPs": flops / rot / 1e9, "vs_sdpa": median(sdpa_ms) / rot,
                "no_rot_vs_sdpa": median(sdpa_ms) / no_rot, "rot_overhead": rot / no_rot - 1}
        say(f"  {ctx}: {name}: {row['TFLOPs']:.0f} TFLOP/s, {row['vs_sdpa']:.3f}x SDPA, "
            f"rotation {row['rot_overhead']:+.1%} (rel vs default {row['rel_vs_default']:.1e})")
    return res


def rotation_table(results: list) -> str:
    """--rotation summary: per variant and size, medians of the interleaved rounds."""
    head = " | ".join(f"{r['ctx']}: TFLOP/s, /SDPA, no-rot /SDPA, overhead" for r in results)
    lines = [f"| rotation variant | {head} |", "|---|" + "---|" * len(results)]
    for name in results[0]["variants"] if results else []:
        cells = [f"{v['TFLOPs']:.0f}, {v['vs_sdpa']:.3f}x, {v['no_rot_vs_sdpa']:.3f}x, {v['rot_overhead'] * 100:+.1f}%"
                 for v in (r["variants"][name] for r in results)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_decode(n_seqs: int, ctx: int, bs: int, dev, inv, smoke: bool) -> dict:
    chunk = min(512, ctx // 8)  # >= 8 chunks: 8 of 512 at 4K, 64 of 512 at 32K
    p = paged(n_seqs, ctx, chunk, 0, bs, dev, seed=1)
    q = torch.randn((n_seqs, HQ, D), device=dev, dtype=torch.bfloat16)
    scale = D ** -0.5
    nbytes = 2 * n_seqs * ctx * HKV * D * 2  # K and V read once
    bw = lambda ms: nbytes / ms / 1e9  # noqa: E731
    tabled = pack(p["block_ids"], p["offsets"], p["masks"], bs, inv, with_table=True)
    plain = pack(p["block_ids"], p["offsets"], p["masks"], bs, inv, with_table=False)
    run = lambda packed, rotate=True, cfg=_decode.DecodeConfig(): _decode.launch(  # noqa: E731
        q, p["k_cache"], p["v_cache"], packed, p["cu_entries"], inv, scale, rotate=rotate, cfg=cfg)
    res = {"batch": n_seqs, "ctx": ctx, "chunks": ctx // chunk, "block_size": bs, "bytes": nbytes,
           "splits": _decode.pick_splits(_decode.DecodeConfig(), n_seqs, HKV, p["block_ids"].numel(), q.device)}
    out, _ = run(plain)
    k4, v4 = contiguous_kv(p, inv)
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    call, res["sdpa_backend"], res["triton_vs_sdpa_rel"] = sdpa_peer(q4, k4, v4, False, out.unsqueeze(2))
    res["table_vs_computed_rel"] = rel(run(tabled)[0], out)
    say(f"decode {n_seqs}x{ctx}: triton vs SDPA ({res['sdpa_backend']}) rel err {res['triton_vs_sdpa_rel']:.2e}")
    res["sdpa_ms"] = timeit(lambda: call(k4, v4))
    cfgs = DECODE_CONFIGS[:1] if smoke else DECODE_CONFIGS
    res["configs"] = {f"w{c.num_warps}/s{c.num_stages}/splits{_decode.pick_splits(c, n_seqs, HKV, p['block_ids'].numel(), q.device)}"
                      f"{'' if c.num_splits else f'(auto,{c.programs_per_sm}/SM)'}": timeit(lambda c=c: run(plain, cfg=c))
                      for c in cfgs}
    best_name = min(res["configs"], key=res["configs"].get)
    best = cfgs[list(res["configs"]).index(best_name)]
    res["best_config"] = best_name
    for rep in (1, 2):
        res[f"rot_computed_ms_{rep}"] = timeit(lambda: run(plain, cfg=best))
        res[f"rot_table_ms_{rep}"] = timeit(lambda: run(tabled, cfg=best))
        res[f"no_rot_ms_{rep}"] = timeit(lambda: run(plain, rotate=False, cfg=best))
    public = lambda: paged_decode_attention(  # noqa: E731
        q, p["k_cache"], p["v_cache"], p["block_ids"], p["offsets"], p["masks"], p["cu_entries"], inv, scale,
        backend="triton")
    res["public_call_ms"] = timeit(public)  # the table packed once, as for every layer after the first
    res["public_call_first_ms"] = timeit(lambda: (_meta._CACHE.clear(), public()))  # validate + pack each time
    for key in ("sdpa", "rot_computed", "rot_table", "no_rot", "public_call", "public_call_first"):
        ms = res[f"{key}_ms"] if f"{key}_ms" in res else (res[f"{key}_ms_1"] + res[f"{key}_ms_2"]) / 2
        res[f"{key}_TBps"] = bw(ms)
    return res


def bench_rope(tokens: int, dev, inv) -> dict:
    from kernels.rope.triton import apply_rope as rope_triton

    x = torch.randn((tokens, HKV, D), device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 65536, (tokens,), device=dev)
    want = apply_rope(x, pos, inv)
    res = {"tokens": tokens, "heads": HKV, "bytes": 2 * x.numel() * 2,
           "computed_rel": rel(rope_triton(x, pos, inv), want), "table_rel": rel(rope_triton(x, pos, inv, True), want)}
    res["computed_ms"] = timeit(lambda: rope_triton(x, pos, inv))
    res["table_ms"] = timeit(lambda: rope_triton(x, pos, inv, True))
    res["torch_ms"] = timeit(lambda: apply_rope(x, pos, inv))
    for key in ("computed", "table", "torch"):
        res[f"{key}_TBps"] = res["bytes"] / res[f"{key}_ms"] / 1e9
    return res


def compiled_report() -> list:
    """Registers, spills, shared memory and async-copy / wgmma counts of every compiled kernel variant."""
    rows = []
    for name, fn in (("prefill", _prefill._prefill_kernel), ("decode", _decode._decode_kernel)):
        for cache in getattr(fn, "device_caches", {}).values():
            for key, k in (cache[0] if isinstance(cache, tuple) else cache).items():
                try:
                    ptx = k.asm.get("ptx", "")
                    rows.append({"kernel": name, "key": str(key)[-160:], "regs": getattr(k, "n_regs", None),
                                 "spills": getattr(k, "n_spills", None), "shared": k.metadata.shared,
                                 "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                                 "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync")})
                except Exception as exc:  # diagnostics only
                    rows.append({"kernel": name, "error": repr(exc)[:200]})
    return rows


def table(results: dict) -> str:
    """The summary printed last: the default variant (cos/sin table) beside its peers."""
    lines = ["| prefill ctx+new | SDPA TFLOP/s | SDPA + rotate-copy | ours | ours/SDPA | ours, no rotation |"
             " rotation overhead | cos/sin computed | public call, cached / first |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["prefill"]:
        lines.append(f"| {r['ctx']}+{r['new']} | {r['sdpa_TFLOPs']:.0f} | {r['sdpa_plus_rotate_TFLOPs']:.0f} | "
                     f"{r['rot_table_TFLOPs']:.0f} | {r['rot_table_TFLOPs'] / r['sdpa_TFLOPs']:.2f}x | "
                     f"{r['no_rot_TFLOPs']:.0f} | {(r['no_rot_TFLOPs'] / r['rot_table_TFLOPs'] - 1) * 100:+.1f}% | "
                     f"{r['rot_computed_TFLOPs']:.0f} | {r['public_call_TFLOPs']:.0f} / {r['public_call_first_TFLOPs']:.0f} |")
    if not results.get("decode"):
        return "\n".join(lines)
    lines += ["", "| decode B x ctx | SDPA TB/s | ours | ours/SDPA | ours, no rotation | rotation overhead |"
              " cos/sin computed | public call, cached / first |", "|---|---|---|---|---|---|---|---|"]
    for r in results["decode"]:
        lines.append(f"| {r['batch']}x{r['ctx']} | {r['sdpa_TBps']:.2f} | {r['rot_table_TBps']:.2f} | "
                     f"{r['rot_table_TBps'] / r['sdpa_TBps']:.2f}x | {r['no_rot_TBps']:.2f} | "
                     f"{(r['no_rot_TBps'] / r['rot_table_TBps'] - 1) * 100:+.1f}% | {r['rot_computed_TBps']:.2f} | "
                     f"{r['public_call_TBps']:.2f} / {r['public_call_first_TBps']:.2f} |")
    r = results["rope"]
    lines += ["", f"RoPE {r['tokens']}x{r['heads']}x{D} bf16: computed {r['computed_TBps']:.2f} TB/s, "
              f"table {r['table_TBps']:.2f} TB/s, torch twin {r['torch_TBps']:.2f} TB/s"]
    return "\n".join(lines)


def sweep_table(results: dict) -> str:
    """--sweep summary: each prefill variant's TFLOP/s, share of SDPA's and rotation overhead per size."""
    lines = ["| variant | " + " | ".join(f"{r['ctx']}: TFLOP/s, /SDPA, rot. overhead" for r in results["prefill"]) + " |",
             "|---|" + "---|" * len(results["prefill"])]
    lines.append("| SDPA | " + " | ".join(f"{r['sdpa_TFLOPs']:.0f}" for r in results["prefill"]) + " |")
    for name in results["prefill"][0]["configs"] if results["prefill"] else []:
        cells = []
        for r in results["prefill"]:
            c = r["configs"].get(name, {})
            cells.append(f"{c.get('TFLOPs', 0):.0f}, {c.get('TFLOPs', 0) / r['sdpa_TFLOPs']:.2f}x, "
                         f"{c.get('rot_overhead', float('nan')) * 100:+.1f}%")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sass_counts(sass: str) -> dict:
    """SASS instruction counts that tell a variant's cost without a GPU: tensor-core ops, local-memory
    spills (LDL/STL) in all and inside the step loop (the innermost backward branch around the first
    HGMMA), shared-memory stores/loads (layout conversions) and MUFU ops (the exponentials)."""
    ins = [(int(m[1], 16), m[2].split(".")[0], m[3]) for m in re.finditer(
        r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass, re.M)]
    mma = [a for a, op, _ in ins if op == "HGMMA"]
    loops = [(int(t.group(1), 16), a) for a, op, rest in ins if op == "BRA"
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < a]
    around = [(lo, hi) for lo, hi in loops if mma and lo <= mma[0] <= hi]
    lo, hi = min(around, key=lambda r: r[1] - r[0]) if around else (0, -1)
    spill = [a for a, op, _ in ins if op in ("LDL", "STL")]
    return {"hgmma": len(mma), "ldl_stl": len(spill), "ldl_stl_in_loop": sum(lo <= a <= hi for a in spill),
            "loop_instrs": sum(lo <= a <= hi for a, _, _ in ins), "sts": sum(op == "STS" for _, op, _ in ins),
            "lds": sum(op == "LDS" for _, op, _ in ins), "mufu": sum(op == "MUFU" for _, op, _ in ins)}


def compile_sm90(configs, bs: int, dump: Path | None = None) -> list:
    """Compile the prefill kernel of every config (rotating with the cos/sin table, and without
    rotation) for sm_90 on a machine with no GPU: Triton's frontend and ptxas, through a stand-in
    driver, specialised exactly as bench_prefill's calls are. Returns registers, stack (spills) and
    shared memory per variant, or the error. Run it before spending GPU time on new variants."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class Sm90(DriverBase):  # what the JIT asks a driver for while compiling
        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            return None

        def get_device_interface(self):
            return None

        def get_empty_cache_for_benchmark(self):
            return None

        def clear_cache(self, cache):
            pass

        def map_python_to_cpp_type(self, ty):
            return ty

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("--compile-only compiles for a GPU: unset TRITON_INTERPRET")

    class WarmupOnly:  # kernel[grid](...) compiles (warmup) instead of launching
        def __init__(self, fn):
            self.fn, self.compiled = fn, []

        def __getitem__(self, grid):
            return lambda *a, **kw: self.compiled.append(self.fn.warmup(*a, grid=grid, **kw))

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    driver.set_active(Sm90())
    saved = (_prefill._prefill_kernel, _prefill._key_bounds_kernel, _meta._pack_kernel)
    kernel = _prefill._prefill_kernel = WarmupOnly(saved[0])
    _prefill._key_bounds_kernel, _meta._pack_kernel = WarmupOnly(saved[1]), WarmupOnly(saved[2])
    rows = []
    try:
        dev = torch.device("cpu")
        inv = rope_inv_freq(D, 500000.0, LLAMA3)
        p = paged(1, 256, 128, 64, bs, dev)  # the benchmark's dtypes and strides, tiny
        q = torch.randn((64, HQ, D), dtype=torch.bfloat16)
        q_pos = torch.arange(256, 320, dtype=torch.int32)
        cu_q = torch.tensor([0, 64], dtype=torch.int32)
        packed = pack(p["block_ids"], p["offsets"], p["masks"], bs, inv, with_table=True, cu_entries=p["cu_entries"])
        for c in configs:
            for rotate in (True, False):
                name = f"{cfg_name(c)}/{'rot' if rotate else 'norot'}"
                t0 = time.perf_counter()
                try:
                    _prefill.launch(q, q_pos, p["k_cache"], p["v_cache"], p["slot_pos"], packed, cu_q, inv,
                                    D ** -0.5, rotate=rotate, cfg=c)
                    k = kernel.compiled[-1]
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(k.asm["cubin"])
                        f.flush()
                        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name],
                                               capture_output=True, text=True).stdout
                        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
                    fields = dict(kv.split(":", 1) for kv in usage.split("Function _prefill_kernel:")[-1].split()
                                  if ":" in kv)
                    rows.append({"variant": name, "regs": int(fields["REG"]), "stack": int(fields["STACK"]),
                                 "shared": k.metadata.shared, "wgmma": k.asm["ptx"].count("wgmma.mma_async"),
                                 **sass_counts(sass), "compile_s": round(time.perf_counter() - t0, 1),
                                 "triton": triton.__version__})
                    if dump:  # TTGIR and SASS per variant, to read where the time goes
                        stem = name.replace("/", "_")
                        (dump / f"{stem}.ttgir").write_text(k.asm["ttgir"])
                        (dump / f"{stem}.sass").write_text(sass)
                except Exception as exc:  # report and go on: the point is to find every failure
                    rows.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        _prefill._prefill_kernel, _prefill._key_bounds_kernel, _meta._pack_kernel = saved
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "kernels")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter): checks the script only")
    ap.add_argument("--bs", type=int, default=16, help="block size of the paged cache")
    ap.add_argument("--sweep", action="store_true",
                    help="every PREFILL_CONFIGS variant timed with and without rotation, not only with")
    ap.add_argument("--prefill-only", action="store_true", help="skip decode and RoPE")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU: compile every prefill variant for sm_90 and print registers / spills")
    ap.add_argument("--dump-asm", type=Path, help="with --compile-only: write each variant's TTGIR and SASS here")
    ap.add_argument("--rotation", action="store_true",
                    help="only the query-rotation variants, with and without rotation, interleaved (4K, 16K)")
    ap.add_argument("--reps", type=int, default=5, help="rounds of --rotation")
    args = ap.parse_args()
    if args.compile_only:
        if args.dump_asm:
            args.dump_asm.mkdir(parents=True, exist_ok=True)
        rows = compile_sm90(PREFILL_CONFIGS, args.bs, args.dump_asm)
        print("\n".join(json.dumps(r) for r in rows))
        return 0 if all("error" not in r for r in rows) else 1
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inv = rope_inv_freq(D, 500000.0, LLAMA3).to(dev)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
               "torch": torch.__version__, "triton": triton.__version__, "heads": [HQ, HKV, D], "dtype": "bfloat16"}
    say(json.dumps(results))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rotation:
        results["checks"] = [] if args.smoke else check_variants(dev, ROTATION_CONFIGS)
        results["rotation"] = [bench_rotation(ctx, new, args.bs, dev, inv, 1 if args.smoke else args.reps, args.smoke)
                               for ctx, new in ([(256, 64)] if args.smoke else [(4096, 512), (16384, 512)])]
        results["compiled"] = compiled_report()
        results["log"] = LOG
        (args.out / "kernels_rotation.json").write_text(json.dumps(results, indent=1))
        print(rotation_table(results["rotation"]))
        return 0
    if not args.smoke:
        results["ceilings"] = ceilings(dev)
        say(f"ceilings: {results['ceilings']}")
        results["checks"] = check_small(dev) + check_variants(dev, PREFILL_CONFIGS)
    pre = [(256, 64)] if args.smoke else [(4096, 512), (16384, 512), (32768, 512)]
    dec = [] if args.prefill_only else [(2, 256)] if args.smoke else [(32, 4096), (8, 32768)]
    results["prefill"], results["decode"] = [], []
    jobs = [("prefill", bench_prefill, (ctx, new)) for ctx, new in pre]
    jobs += [("decode", bench_decode, (n, ctx)) for n, ctx in dec]
    for kind, fn, shape in jobs:
        try:
            extra = {"sweep": args.sweep} if kind == "prefill" else {}
            results[kind].append(fn(*shape, args.bs, dev, inv, args.smoke, **extra))
            say(json.dumps(results[kind][-1]))
        except Exception as exc:  # keep what was measured; the log says what failed
            say(f"{kind} {shape} FAILED: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        (args.out / "kernels.json").write_text(json.dumps(results | {"log": LOG}, indent=1))
    if args.prefill_only:
        results["compiled"] = compiled_report()
        results["log"] = LOG
        (args.out / "kernels.json").write_text(json.dumps(results, indent=1))
        print(sweep_table(results))
        print(table(results))
        return 0
    results["rope"] = bench_rope(64 if args.smoke else 32768, dev, inv)
    say(json.dumps(results["rope"]))
    try:
        results["compiled"] = compiled_report()
        for row in results["compiled"]:
            say(json.dumps(row))
    except Exception as exc:
        say(f"compiled report failed: {exc!r}")
    results["log"] = LOG
    (args.out / "kernels.json").write_text(json.dumps(results, indent=1))
    if args.sweep:
        print(sweep_table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
