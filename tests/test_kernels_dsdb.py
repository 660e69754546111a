"""The cuBLAS layer's dS/dB kernel (bdlora.kernels.cublas.dsdb_dense, one read of dY for both products) against
its float64 reference; the layer end to end with it on and off is in test_kernels_dropout."""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and bdlora.kernels) is imported
for _m in [m for m in sys.modules if m.startswith("bdlora.kernels")]:
    del sys.modules[_m]

import pytest  # noqa: E402
import torch  # noqa: E402

from bdlora.kernels import cublas as C  # noqa: E402
from bdlora.layout import unpack_block_diagonal  # noqa: E402


@pytest.mark.parametrize("rows", [0, 1, 37, 130])
@pytest.mark.parametrize("rank", [8, 16, 64])
# 75: not a multiple of the column chunk; (52, 4) and (52, 2): B's blocks of 13 / 26 rows end inside a chunk
@pytest.mark.parametrize("d_out,nblocks", [(48, 1), (75, 1), (48, 4), (52, 4), (52, 2)])
def test_dsdb_dense_matches_float64_reference(rows, rank, d_out, nblocks):
    """dS and dB against float64, B dense or block-diagonal (zeros stored, dB packed: only its diagonal blocks)."""
    gen = torch.Generator().manual_seed(rows * 1000 + rank * 10 + d_out + nblocks)
    wide = torch.randn(rows + 2, d_out + 5, generator=gen)
    dy = wide[1:rows + 1, 2:d_out + 2]  # a row- and column-offset view: row stride d_out + 5, unit column stride
    s = torch.randn(rows, rank, generator=gen)
    b = unpack_block_diagonal(torch.randn(d_out, rank // nblocks, generator=gen), nblocks)
    ds, db = C.dsdb_dense(dy, s, b, nblocks)
    assert ds.dtype == db.dtype == torch.float32 and ds.shape == (rows, rank) and db.shape == (d_out, rank // nblocks)
    ds64, db64 = C.dsdb_dense_ref(dy.double(), s.double(), b.double(), nblocks)
    # the reference's packed layout, spelled out: block j of dB's rows holds the dense gradient's j-th diagonal block
    dense64, ob, rb = dy.double().t() @ s.double(), d_out // nblocks, rank // nblocks
    assert torch.equal(db64, torch.cat([dense64[j * ob:(j + 1) * ob, j * rb:(j + 1) * rb] for j in range(nblocks)]))
    tol = dict(rtol=2e-5, atol=2e-5 * max(1.0, rows ** 0.5, d_out ** 0.5))
    torch.testing.assert_close(ds.double(), ds64, **tol)
    torch.testing.assert_close(db.double(), db64, **tol)


def test_dsdb_dense_gate():
    """On CPU the kernel runs only when asked (tests); above DSDB_MAX_RANK or with mixed dtypes never."""
    dy, b = torch.randn(4, 8), torch.randn(8, 16)
    assert not C.dsdb_ok(dy, b, None)
    assert C.dsdb_ok(dy, b, True)
    assert not C.dsdb_ok(dy, torch.randn(8, C.DSDB_MAX_RANK + 1), True)
    assert not C.dsdb_ok(dy, b.double(), True)
    assert not C.dsdb_ok(dy, b, False)
    with pytest.raises(ValueError, match="db_blocks 3 does not divide"):
        C.dsdb_dense(dy, torch.randn(4, 16), b, 3)
