"""LoRA dropout (bdlora.kernels.dropout): the counter-hash mask (Triton == torch twin, bit for bit; statistics),
the cuBLAS path's three fused dropout kernels against float64 references, and that path end to end with the
kernels on (Triton interpreter) and off (materialized mask), and with its dS/dB kernel on and off: same masks, so
all equal the float64 oracle."""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and bdlora.kernels) is imported
for _m in [m for m in sys.modules if m.startswith("bdlora.kernels")]:
    del sys.modules[_m]

import pytest  # noqa: E402
import torch  # noqa: E402

import bdlora.kernels as K  # noqa: E402
from bdlora.kernels import dropout as D  # noqa: E402
from bdlora.layout import LoraFactors, unpack_block_diagonal  # noqa: E402


def test_triton_hash_equals_torch_twin_bit_for_bit():
    for seed, index, rows, cols, p in [(0, 0, 1, 1, 0.1), (77, 3, 37, 130, 0.25), (2**40 + 5, 11, 5, 1001, 0.5),
                                       (123, 0, 64, 64, 0.9), (5, 2, 3, 7, 1.0), (5, 2, 3, 7, 0.0)]:
        keys = D.dropout_keys(seed, index)
        assert all(0 <= k < 2**31 for k in keys)
        want = D.keep_mask_torch(keys, rows, cols, p)
        got = D.keep_mask_triton(keys, rows, cols, p, "cpu")
        assert got.shape == (rows, cols) and got.dtype == torch.bool
        assert torch.equal(got, want), (seed, index, rows, cols, p)
    # the public masks are this hash: segment i under (seed, i); the grouped kernels' mask is index 0
    assert torch.equal(K.segment_keep_mask(9, 2, 7, 33, 0.3, "cpu"),
                       D.keep_mask_torch(D.dropout_keys(9, 2), 7, 33, 0.3))
    assert torch.equal(K.dropout_keep_mask(9, (7, 33), 0.3), K.segment_keep_mask(9, 0, 7, 33, 0.3, "cpu"))


def test_mask_statistics():
    rows, cols = 256, 512
    for p in (0.05, 0.1, 0.5):
        keep = D.keep_mask_torch(D.dropout_keys(1, 0), rows, cols, p).float()
        n = rows * cols
        assert abs(keep.mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5  # 5 sigma
        # neighbouring elements (same row, next column; same column, next row) are uncorrelated
        for a, b in ((keep[:, :-1], keep[:, 1:]), (keep[:-1], keep[1:])):
            corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
            assert abs(corr) < 0.02
    m = D.keep_mask_torch(D.dropout_keys(1, 0), 64, 64, 0.5)
    for other in (D.dropout_keys(2, 0), D.dropout_keys(1, 1)):  # another seed, another adapter
        agree = (m == D.keep_mask_torch(other, 64, 64, 0.5)).float().mean().item()
        assert 0.45 < agree < 0.55
    assert D.keep_threshold(0.1) == 6554 and D.keep_threshold(0.0) == 0 and D.keep_threshold(1.0) == 65536
    assert D.keep_mask_torch(D.dropout_keys(1, 0), 8, 8, 0.0).all()
    assert not D.keep_mask_torch(D.dropout_keys(1, 0), 8, 8, 1.0).any()


def test_counters_beyond_int31_are_refused():
    with pytest.raises(ValueError, match="2\\^31"):
        K.segment_keep_mask(1, 0, 2**17, 2**15, 0.1, "cpu")


@pytest.mark.parametrize("rows", [0, 1, 37, 130])
@pytest.mark.parametrize("rank", [8, 16, 64, 100])
@pytest.mark.parametrize("d_in", [72, 75])  # not a multiple of the tile; odd: a last column without its pair
def test_fused_dropout_kernels_match_float64_references(rows, rank, d_in):
    gen = torch.Generator().manual_seed(rows * 1000 + rank + d_in)
    p, alpha = 0.3, 1.7
    keys = D.dropout_keys(5, 1)
    keep = D.keep_mask_torch(keys, rows, d_in, p).double()
    x = torch.randn(rows + 3, d_in, generator=gen)[2:rows + 2]  # a row-offset view, as a segment of x
    a = torch.randn(rank, d_in, generator=gen)
    ds = torch.randn(rows, rank, generator=gen)
    s = torch.full((rows, rank), float("nan"))
    D.drop_shrink(s, x, a, keys, p, alpha)
    dx = torch.full((rows + 2, d_in), float("nan"))
    D.drop_expand_t(dx[1:rows + 1], ds, a, keys, p, alpha)
    da = D.drop_wgrad_a(x, ds, keys, p, alpha)
    x64, a64, ds64 = x.double(), a.double(), ds.double()
    tol = dict(rtol=2e-5, atol=2e-5 * max(1.0, rows ** 0.5))
    torch.testing.assert_close(s.double(), D.drop_shrink_ref(x64, a64, keep, alpha), **tol)
    torch.testing.assert_close(dx[1:rows + 1].double(), D.drop_expand_t_ref(ds64, a64, keep, alpha), **tol)
    assert dx[0].isnan().all() and dx[rows + 1].isnan().all()  # rows outside the view untouched
    assert da.dtype == torch.float32 and da.shape == (rank, d_in)
    torch.testing.assert_close(da.double(), D.drop_wgrad_a_ref(x64, ds64, keep, alpha), **tol)


def _adapter(gen, r, layout, n, d_in, d_out, dropout):
    na, nb = (n, 1) if layout == "row" else (1, n)
    a = torch.randn(r, d_in // na, generator=gen) / (d_in // na) ** 0.5
    b = torch.randn(d_out, r // nb, generator=gen) / (r // nb) ** 0.5
    return LoraFactors(a.requires_grad_(), b.requires_grad_(), layout, n, 1.5, dropout)


@pytest.mark.parametrize("dsdb", [True, False])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bd_gemm", ["dense", "blocks"])
def test_cublas_path_with_and_without_fused_dropout(fused, bd_gemm, dsdb):
    """Both routes draw the same masks: outputs and every gradient equal the float64 oracle with those masks. Mixed
    layouts/ranks, an empty and a one-row segment, rows in no segment, one adapter without dropout. With
    bd_gemm="blocks" the row-layout adapter's A stays packed, so its dropout takes the mask route either way.
    ``dsdb``: dS and dB from the one-read Triton kernel (fp32 dS into the dropout kernels, or cast for the GEMMs)
    where B is dense as the GEMMs see it, else the two GEMMs."""
    gen = torch.Generator().manual_seed(11 + fused)
    d_in, d_out, t = 64, 48, 40
    seg = [0, 0, 1, 20, 33]
    ads = [_adapter(gen, 16, "column", 4, d_in, d_out, 0.25), _adapter(gen, 8, "row", 2, d_in, d_out, 0.5),
           _adapter(gen, 32, "row", 4, d_in, d_out, 0.1), _adapter(gen, 16, "column", 2, d_in, d_out, 0.0)]
    x = torch.randn(t, d_in, generator=gen).requires_grad_()
    w = torch.randn(d_out, d_in, generator=gen) / 8
    y, d = K.fused_lora_linear(x, w, None, seg, ads, dropout_seed=21,
                               options=K.KernelOptions(backend="cublas", bd_gemm=bd_gemm, fused_dropout=fused,
                                                       fused_dsdb=dsdb, poison_outputs=True))
    route = [r for r in d.dropout if r != "none"][-1]  # the last adapter with dropout: row layout, r=32
    assert route == ("triton" if fused and bd_gemm == "dense" else "mask")
    g = torch.randn(t, d_out, generator=gen)
    params = [x] + [p for ad in ads for p in (ad.lora_A, ad.lora_B)]
    grads = torch.autograd.grad(y, params, g)
    # the last adapter: column layout, B in 2 blocks: dense for bd_gemm="dense", packed (two GEMMs) for "blocks"
    assert d.dsdb[-1] == ("triton" if dsdb and bd_gemm == "dense" else "cublas")
    # float64 oracle: dense factors, the same masks
    masks = K.torch_keep_masks(x, seg, ads, 21)
    leaves = [x.detach().double().requires_grad_()]
    y64 = leaves[0] @ w.double().t()
    for i, ad in enumerate(ads):
        a = ad.lora_A.detach().double().requires_grad_()
        b = ad.lora_B.detach().double().requires_grad_()
        leaves += [a, b]
        A = unpack_block_diagonal(a, ad.blocks_a)
        B = unpack_block_diagonal(b, ad.blocks_b)
        xi = leaves[0][seg[i]:seg[i + 1]]
        if masks[i] is not None:
            xi = xi * masks[i][seg[i]:seg[i + 1]].double() / (1 - ad.dropout)
        rows = torch.zeros_like(y64)
        rows[seg[i]:seg[i + 1]] = ad.scale * (xi @ A.t()) @ B.t()
        y64 = y64 + rows
    grads64 = torch.autograd.grad(y64, leaves, g.double())
    for got, want in zip([y, *grads], [y64, *grads64]):
        scale = max(1.0, float(want.detach().abs().max()))
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5 * scale)
