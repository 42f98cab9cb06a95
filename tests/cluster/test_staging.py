"""services/cluster/staging.py's host buffers: a chunk's layers in one allocation a dtype."""

import torch

from services.cluster.staging import pinned_like


def test_pinned_like_cuts_one_allocation_a_dtype_into_disjoint_views_of_each_shape():
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5, 7), (1,), (4, 2), (3, 5, 7), (0, 3)]
    tensors = [torch.randn(s, generator=g, dtype=torch.bfloat16) for s in shapes]
    tensors.append(torch.randn(6, 2, generator=g).t())         # float32, not contiguous
    out = pinned_like(tensors, pin=False)
    assert [o.shape for o in out] == [t.shape for t in tensors]
    assert [o.dtype for o in out] == [t.dtype for t in tensors]
    assert all(o.is_contiguous() for o in out)
    bf16 = [o for o in out if o.dtype == torch.bfloat16]
    assert len({o.untyped_storage().data_ptr() for o in bf16}) == 1      # one allocation for the bf16 ones
    assert out[-1].untyped_storage().data_ptr() != bf16[0].untyped_storage().data_ptr()
    assert bf16[0].untyped_storage().nbytes() == sum(t.numel() for t in tensors[:-1]) * 2
    for o, t in zip(out, tensors):      # each written apart: no view overlaps another
        o.copy_(t)
    for o, t in zip(out, tensors):
        assert torch.equal(o, t)
