"""The prefill kernel's KV splits merging their own partials (PrefillConfig(merge="fused"); see _prefill.py).

Without it, every split program writes its fp32 partial (output rows + LSE) and a second launch
(kernels/lse_merge) merges the splits. With it, the split programs of one (query tile, KV head) count
their arrivals on a per-(tile, head) counter after writing their partials; the LAST to arrive reads all
the group's partials back IN SPLIT ORDER, merges them with the lse_merge kernel's own arithmetic
(merge_step / merge_finish) and writes the final output, then resets the counter to 0. One launch, no
merge boundary; nobody waits for anybody (the last arriver has everything it needs the moment it
arrives), so it cannot deadlock, and under Triton's interpreter (programs run one at a time) the last
program of each group simply does the merge.

Determinism: whoever arrives last, the partials are read from memory in split order (its own included,
not taken from its registers), so the result is the same bits every run, and the same bits as the
two-launch path wherever both compile alike (the interpreter, and the H100 with Triton 3.6; another
compiler may contract the two kernels' multiply-adds differently).

Cost (H100, bench/short_attention/README.md): each group's last program reads all the group's parts on
one SM, so the merge runs on (tiles x KV heads) SMs; for the 64-query short pass (32 groups, 8 x 32 KB
each) that is slower than the separate merge kernel's 128 programs (32.6 against 26.5 us a call).

The counters: a kernels/counters.py pool (the skinny GEMM's split-K "last program reduces" mode keeps
another), zero between launches because each last arriver resets its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.counters import ArrivalCounters
from kernels.lse_merge.triton import merge_finish, merge_step

MAX_GROUPS_COUNTED = 1 << 14  # (tile, KV head) counters kept per device (a launch with more gets its own zeros)
_COUNTERS = ArrivalCounters(MAX_GROUPS_COUNTED)


def arrival_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``groups`` (tile, KV head) groups, each reset to 0 by the program
    that merges its group (kernels/counters.py)."""
    return _COUNTERS.get(device, groups)


@triton.jit
def _load_part(o_ptrs, l_ptrs, ok, row_ok, p, stride_os, stride_ls):
    """Part p's output rows and LSEs. .cg: read past L1, which may hold an earlier launch's partials."""
    o = tl.load(o_ptrs + p * stride_os, mask=ok, other=0.0, cache_modifier=".cg")
    lse = tl.load(l_ptrs + p * stride_ls, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
    return o, lse


@triton.jit
def arrive_and_merge(out_ptr, lse_ptr, fin_ptr, fin_lse_ptr, cnt_ptr, group, n_split, o_rows, l_rows, row_ok,
                     stride_os, stride_ls, D: tl.constexpr):
    """Called by every split program of a group after storing its partial. out_ptr / lse_ptr: the partials
    [n_split, ...] (split p's row r at o_rows[r] + p * stride_os, its LSE at l_rows[r] + p * stride_ls);
    fin_ptr / fin_lse_ptr: the merged output and LSE, same row offsets, no split; o_rows [BLOCK_M] int64,
    l_rows [BLOCK_M], row_ok [BLOCK_M] (rows past the sequence's end or padding heads: neither read nor
    written). group: this (tile, KV head)'s counter."""
    tl.debug_barrier()  # every thread's partial is stored before the release below
    arrived = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel")
    if arrived == n_split - 1:  # the last of the group: merge the splits in order, then reset the counter
        tl.debug_barrier()
        dd = tl.arange(0, D)
        o_ptrs = out_ptr + o_rows[:, None] + dd[None, :]
        l_ptrs = lse_ptr + l_rows
        ok = row_ok[:, None]
        m = tl.full(row_ok.shape, float("-inf"), tl.float32)
        l = tl.zeros(row_ok.shape, tl.float32)  # noqa: E741
        acc = tl.zeros(o_ptrs.shape, tl.float32)
        # the next part's loads are issued before this part's arithmetic (a [64, 128] fp32 part is 64 registers
        # a thread: two in flight spilled and were slower on an H100, bench/short_attention/README.md); past
        # the last part the last is read again (in bounds, never used)
        o_next, l_next = _load_part(o_ptrs, l_ptrs, ok, row_ok, 0, stride_os, stride_ls)
        for p in range(0, n_split):
            o_p = o_next
            lse_p = l_next
            o_next, l_next = _load_part(o_ptrs, l_ptrs, ok, row_ok, tl.minimum(p + 1, n_split - 1), stride_os,
                                        stride_ls)
            m, l, acc = merge_step(m, l, acc, lse_p, o_p)  # noqa: E741
        out, lse = merge_finish(m, l, acc)
        tl.store(fin_ptr + o_rows[:, None] + dd[None, :], out.to(fin_ptr.dtype.element_ty), mask=ok)
        tl.store(fin_lse_ptr + l_rows, lse, mask=row_ok)
        tl.atomic_xchg(cnt_ptr + group, 0)
