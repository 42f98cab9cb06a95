"""Quest sparse decode, Triton (twin: reference.py; same arguments, same results).

The public functions check their inputs once and launch the page-bounds (_bounds.py), page-score (_scores.py),
selection (_select.py) and sparse attention (_attend.py) kernels. None syncs with the device or allocates but its outputs (and the split
partials of the attention), and each grid is a function of the shapes alone.
"""

from __future__ import annotations

import torch

from kernels.sparse import _attend, _bounds, _scores, _select

__all__ = ["bound_pages", "page_scores", "select_pages", "sparse_decode_attention", "sparse_decode_parts"]


def _index(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got {tuple(t.shape)}")
    return t.to(dtype).contiguous()


def _ids(name: str, t: torch.Tensor) -> torch.Tensor:
    """int32 or int64 as given: the kernels read either (the decode graphs' tables are int64; a cast would be one
    more kernel a table and call)."""
    return _index(name, t, t.dtype if t.dtype in (torch.int32, torch.int64) else torch.int32)


def _table(block_ids, offsets, masks):
    if not block_ids.shape == offsets.shape == masks.shape:
        raise ValueError(f"block_ids {tuple(block_ids.shape)}, offsets {tuple(offsets.shape)} and masks "
                         f"{tuple(masks.shape)} must be 1-D of one length")
    return _ids("block_ids", block_ids), _ids("offsets", offsets), _index("masks", masks, torch.int64)


def _check_query(q, dim, inv_freq) -> None:
    if q.dim() != 3 or q.shape[2] != dim:
        raise ValueError(f"q {tuple(q.shape)} must be [rows, Hq, D] with D = {dim}")
    if dim < 32 or dim & (dim - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 32, got {dim}")
    if inv_freq.numel() != dim // 2:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries, head_dim {dim} needs {dim // 2}")


def bound_pages(k_cache, kmin, kmax, blocks, visible) -> None:
    """In place: the page bounds of blocks over their visible slots (see reference.bound_pages)."""
    if k_cache.dim() != 4 or kmin.shape != kmax.shape or kmin.shape != k_cache.shape[:1] + k_cache.shape[2:]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} must be [N, BS, Hkv, D] and kmin {tuple(kmin.shape)}, kmax "
                         f"{tuple(kmax.shape)} both [N, Hkv, D]")
    if kmin.stride() != kmax.stride() or kmin.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("kmin and kmax must share strides, and they and k_cache need a contiguous head dimension")
    if kmin.dtype != k_cache.dtype or kmax.dtype != k_cache.dtype:
        raise ValueError(f"bounds {kmin.dtype}, {kmax.dtype} must be in the cache's dtype {k_cache.dtype}")
    if blocks.dim() != 1 or visible.shape != (blocks.numel(), k_cache.shape[1]) or visible.dtype != torch.bool:
        raise ValueError(f"blocks {tuple(blocks.shape)} must be 1-D [n] and visible {visible.dtype} "
                         f"{tuple(visible.shape)} bool [n, {k_cache.shape[1]}]")
    if visible.numel() and visible.stride(1) != 1:
        visible = visible.contiguous()
    _bounds.launch(k_cache, kmin, kmax, blocks.contiguous(), visible.view(torch.uint8))


def page_scores(q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq):
    """q [B, Hq, D], page bounds [N, Hkv, D] -> fp32 [E, Hkv], stored head-major (a selection row is contiguous)
    (see reference.page_scores)."""
    if kmin.shape != kmax.shape or kmin.dim() != 3 or kmin.stride() != kmax.stride() or kmax.stride(2) != 1:
        raise ValueError(f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} must both be [N, Hkv, D], "
                         "with one set of strides and a contiguous head dimension")
    _check_query(q, kmax.shape[2], inv_freq)
    if q.shape[1] % kmax.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kmax.shape[1]} KV heads")
    if cu_entries.numel() != q.shape[0] + 1:
        raise ValueError(f"cu_entries has {cu_entries.numel()} bounds for {q.shape[0]} sequences")
    block_ids, offsets, masks = _table(block_ids, offsets, masks)
    q = q if q.stride(2) == 1 else q.contiguous()
    return _scores.launch(q, kmin, kmax, block_ids, offsets, masks, _index("cu_entries", cu_entries, torch.int32),
                          inv_freq.to(device=q.device, dtype=torch.float32).contiguous())


def select_pages(scores, cu_entries, budget_pages: int):
    """scores fp32 [E, Hkv] (any strides: page_scores' are head-major) -> (sel int32 [B, Hkv, budget_pages], count
    int32 [B, Hkv]) (see reference.select_pages)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [E, Hkv], got {scores.dtype} {tuple(scores.shape)}")
    if cu_entries.dim() != 1 or cu_entries.numel() < 1:
        raise ValueError("cu_entries must be 1-D [B+1]")
    return _select.launch(scores, _index("cu_entries", cu_entries, torch.int32), budget_pages)


def sparse_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, scale,
                            spare: int | None = None):
    """q [R, Hq, D] over the entries sel[r, h, :count[r, h]] -> out [R, Hq, D] (q.dtype), lse [R, Hq] fp32
    (``spare``: ``sparse_decode_parts``' answer instead)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be [N, BS, Hkv, D]")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head dimension")
    _check_query(q, k_cache.shape[3], inv_freq)
    hkv = k_cache.shape[2]
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if sel.dim() != 3 or sel.shape[:2] != (q.shape[0], hkv) or count.shape != sel.shape[:2]:
        raise ValueError(f"sel {tuple(sel.shape)} must be [R, Hkv, K] and count {tuple(count.shape)} [R, Hkv] "
                         f"for {q.shape[0]} rows and {hkv} KV heads")
    block_ids, offsets, masks = _table(block_ids, offsets, masks)
    q = q if q.stride(2) == 1 else q.contiguous()
    return _attend.launch(q, k_cache, v_cache, block_ids, offsets, masks, sel.to(torch.int32).contiguous(),
                          count.to(torch.int32).contiguous(),
                          inv_freq.to(device=q.device, dtype=torch.float32).contiguous(), scale, spare=spare)


def sparse_decode_parts(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, scale, spare: int):
    """The attention's KV splits unmerged, fp32, and ``spare`` parts after them left unwritten for the caller:
    (outs [S + spare, R, Hq, D], lses [S + spare, R, Hq]) (see reference.sparse_decode_parts)."""
    return sparse_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, scale,
                                   spare=spare)
