"""Block-diagonal packing (``bdlora.layout``): unpacking and packing against ``torch.block_diag``, any strides,
dtypes, gradients, and shapes with no equal blocks refused."""

from __future__ import annotations

import pytest
import torch

from bdlora.layout import diag_blocks, pack_block_diagonal, unpack_block_diagonal

SHAPES = [(6, 9, 3), (8, 4, 4), (12, 10, 2), (5, 7, 1)]  # (M, K, N): dense (M, K), packed (M, K/N)


def _packed(m, k, n, seed=0, dtype=torch.float64):
    return torch.randn(m, k // n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_unpack_is_block_diag_of_the_row_blocks_and_pack_inverts_it(m, k, n):
    w = _packed(m, k, n)
    full = unpack_block_diagonal(w, n)
    assert torch.equal(full, torch.block_diag(*w.chunk(n, 0)))
    assert torch.equal(pack_block_diagonal(full, n), w)
    assert unpack_block_diagonal(w, n, torch.float32).dtype == torch.float32
    assert torch.equal(unpack_block_diagonal(w, n, torch.float32), full.float())


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_pack_reads_any_strides_and_drops_the_off_diagonal_blocks(m, k, n):
    dense = torch.randn(m, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = torch.cat([dense[i * m // n:(i + 1) * m // n, i * k // n:(i + 1) * k // n] for i in range(n)], 0)
    transposed = dense.t().contiguous().t()  # the same values, column-major
    offset = torch.zeros(m + 1, k + 3, dtype=torch.float64)[1:, 2:-1]  # a view with a storage offset and padding
    offset.copy_(dense)
    for full in (dense, transposed, offset):
        assert torch.equal(pack_block_diagonal(full, n), want)
        assert torch.equal(diag_blocks(full, n), want.view(n, m // n, k // n))
    assert pack_block_diagonal(dense, n, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gradients_flow_as_through_block_diag(m, k, n):
    w = _packed(m, k, n).requires_grad_()
    ref = w.detach().clone().requires_grad_()
    g = torch.randn(m, k, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (unpack_block_diagonal(w, n) * g).sum().backward()
    (torch.block_diag(*ref.chunk(n, 0)) * g).sum().backward()
    assert torch.equal(w.grad, ref.grad)
    full = torch.randn(m, k, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    (pack_block_diagonal(full, n) * w.detach()).sum().backward()
    assert torch.equal(full.grad, torch.block_diag(*w.detach().chunk(n, 0)))


def test_shapes_without_equal_blocks_are_refused():
    with pytest.raises(ValueError, match=r"a \(6, 9\) matrix has no 2 equal diagonal blocks"):
        pack_block_diagonal(torch.zeros(6, 9), 2)
    with pytest.raises(ValueError, match=r"a \(7, 6\) matrix has no 2 equal diagonal blocks"):
        unpack_block_diagonal(torch.zeros(7, 3), 2)
