"""How a KV split of the prefill kernel finds its work, and what it asks memory for early (see _prefill.py).

A sequence's entries form offset groups (_meta.py); the kernel walks a group NB entries (one step) at a time.
Two ways to cut a sequence into n_split parts (PrefillConfig.plan):

- "entries": equal runs of entries [lo, hi); each split then binary-searches the group starts for the groups
  its run touches. Split boundaries fall anywhere inside a group, so a split often ends on a partial step
  and starts with another, and the searches are a chain of ~2 log2(groups) dependent loads before the
  first key is read (~0.4 us of L2 latency each on an H100).
- "steps": equal runs of STEPS [a, b) of the sequence's step list (each group's entries rounded up to
  whole steps, so no split cuts a step in two). The group starts of the sequence are read as one vector
  of GP lanes (GP > the sequence's groups; the launcher knows a bound: the table's entry count) and the
  split's first group, its first step and the group bounds come from vector sums: one load, no chain.

prefetch_kv asks L2 for every K/V row of a run of entries (PTX prefetch.global.L2, a hint: results do not
depend on it): in the engine every layer's keys come from HBM (the matmuls between layers evict L2), and
the step loop keeps only one step of K/V in flight, so each step waits for HBM latency; prefetched rows are
L2 hits. Inline assembly does not run in Triton's interpreter: there the same addresses are read instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

PLANS = ("entries", "steps")
# prefetch.global.L2 of address $1 when $2 is not 0 ($0: a dummy result, inline assembly must return one)
_PREFETCH = tl.constexpr("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\t"
                         "mov.u32 $0, 0;\n\t}")
MAX_PLAN_GROUPS = 1024  # GP above this: the "steps" plan's vector would not fit registers; "entries" is used


@triton.jit
def _lane(vec, idx, at):
    """vec[at] as a scalar (at indexes the lanes idx; 0 when out of range)."""
    return tl.sum(tl.where(idx == at, vec, 0), axis=0)


@triton.jit
def plan_by_steps(starts_ptr, g_lo, g_hi, split, n_split, NB: tl.constexpr, GP: tl.constexpr):
    """The groups and steps of KV split `split` of a sequence owning groups [g_lo, g_hi) (any g_hi <= g_lo:
    nothing). Returns (g_first, g_end, e_first, e_next, p_first, a, b, e_stop): the split walks groups
    [g_first, g_end); g_first spans entries [e_first, e_next) and starts at step p_first of the sequence;
    the split owns steps [a, b); its entries end at e_stop."""
    gi = tl.arange(0, GP)
    n_g = tl.maximum(g_hi - g_lo, 0)
    first = tl.load(starts_ptr + g_lo + gi, mask=gi <= n_g, other=0)  # group starts, then the last end
    last = tl.load(starts_ptr + g_lo + gi + 1, mask=gi < n_g, other=0)  # group ends
    steps = tl.where(gi < n_g, (last - first + NB - 1) // NB, 0)
    incl = tl.cumsum(steps, 0)
    excl = incl - steps  # the step each group starts at
    total = tl.sum(steps, axis=0)
    a = split * total // n_split  # balanced: split sizes differ by at most one step
    b = (split + 1) * total // n_split
    j0 = tl.sum(((incl <= a) & (gi < n_g)).to(tl.int32), axis=0)  # groups wholly before step a
    j1 = tl.sum(((excl < b) & (gi < n_g)).to(tl.int32), axis=0)  # groups starting before step b
    j1 = tl.maximum(j1, j0)
    e_first = _lane(first, gi, j0)
    e_next = _lane(last, gi, j0)
    p_first = _lane(excl, gi, j0)
    e_last = _lane(first, gi, j1 - 1)  # the last group's bounds: where the split's entries stop
    e_stop = tl.minimum(e_last + (b - _lane(excl, gi, j1 - 1)) * NB, _lane(last, gi, j1 - 1))
    e_stop = tl.where(j1 > j0, e_stop, e_first)
    return g_lo + j0, g_lo + j1, e_first, e_next, p_first, a, b, e_stop


@triton.jit
def prefetch_kv(k_ptr, v_ptr, meta_ptr, e_lo, e_hi, h, stride_kb, stride_ks, stride_kh,
                BS: tl.constexpr, EPS: tl.constexpr, LINES: tl.constexpr, LINE: tl.constexpr,
                EMULATE: tl.constexpr = False):
    """prefetch.global.L2 of KV head h's rows of entries [e_lo, e_hi), EPS entries at a time: each row is
    LINES cache lines of LINE elements. Reading the entries' words also leaves them in L1 for the step loop.
    EMULATE (the interpreter, which has no inline assembly): plain loads of the same addresses instead."""
    r = tl.arange(0, EPS * BS * LINES)
    slot = (r // LINES) % BS
    line = r % LINES
    for e0 in range(e_lo, e_hi, EPS):
        e = e0 + r // (BS * LINES)
        ok = e < e_hi
        blk = tl.load(meta_ptr + e, mask=ok, other=0) >> 32
        row = blk * stride_kb + slot * stride_ks + h * stride_kh + line * LINE
        row = tl.where(ok, row, 0)  # lanes past the run point at row 0 of block 0 (valid memory), predicated off
        if EMULATE:
            tl.load(k_ptr + row, mask=ok)
            tl.load(v_ptr + row, mask=ok)
        else:
            on = ok.to(tl.int32)
            tl.inline_asm_elementwise(_PREFETCH, "=r,l,r", [k_ptr + row, on], dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise(_PREFETCH, "=r,l,r", [v_ptr + row, on], dtype=tl.int32, is_pure=False, pack=1)
