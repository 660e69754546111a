"""bdlora.kernels against float64 autograd oracles, on CPU through the Triton interpreter.

The oracle builds the dense factors itself (torch.block_diag of the packed blocks, as PEFT does), so it shares
no code with the kernels or their torch references.
"""
import dataclasses
import os
import subprocess
import sys
import zlib

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and bdlora.kernels) is imported
for _m in [m for m in sys.modules if m.startswith("bdlora.kernels")]:
    del sys.modules[_m]  # a module imported earlier without the interpreter would freeze the torch path

import pytest  # noqa: E402
import torch  # noqa: E402

import bdlora.kernels as K  # noqa: E402
from bdlora.layout import LoraFactors, from_math, to_math  # noqa: E402
from bdlora.kernels import cublas as cublas_mod  # noqa: E402
from bdlora.kernels import dispatch as dispatch_mod  # noqa: E402
from bdlora.kernels import dropout as dropout_mod  # noqa: E402
from folded_cases import folded_layer, folded_oracle  # noqa: E402

D_IN, D_OUT = 64, 96


# every kernel/GEMM output buffer NaN-filled first, so elements a kernel forgets fail
P = K.KernelOptions(poison_outputs=True)


def opts(**kw) -> K.KernelOptions:
    return dataclasses.replace(P, **kw)


def make_adapter(gen, r, layout, n, d_in=D_IN, d_out=D_OUT, dropout=0.0):
    na, nb = (n, 1) if layout == "row" else (1, n)
    a = torch.randn(r, d_in // na, generator=gen) / (d_in // na) ** 0.5
    b = torch.randn(d_out, r // nb, generator=gen) / (r // nb) ** 0.5
    scale = float(torch.rand(1, generator=gen)) + 0.5
    return LoraFactors(a.requires_grad_(), b.requires_grad_(), layout, n, scale, dropout)


def dense64(ad):
    """Oracle dense math factors (float64 leaves): A (d_in, r), B (r, d_out)."""
    a = ad.lora_A.detach().double().requires_grad_()
    b = ad.lora_B.detach().double().requires_grad_()
    na, nb = (ad.nblocks, 1) if ad.layout == "row" else (1, ad.nblocks)
    A = torch.block_diag(*torch.chunk(a, na, dim=0)).t()
    B = torch.block_diag(*torch.chunk(b, nb, dim=0)).t()
    return a, b, A, B


def oracle(x, seg, adapters, grad, weight=None, bias=None, masks=None):
    """float64 y and grads (x, [weight, bias], a_0, b_0, ...) by autograd over dense factors."""
    x64 = x.detach().double().requires_grad_()
    leaves, y = [x64], torch.zeros(x.shape[0], adapters[0].d_out, dtype=torch.float64)
    if weight is not None:
        w64 = weight.detach().double().requires_grad_()
        leaves.append(w64)
        y = y + x64 @ w64.t()
        if bias is not None:
            b64 = bias.detach().double().requires_grad_()
            leaves.append(b64)
            y = y + b64
    rows = []
    for i, ad in enumerate(adapters):
        a, b, A, B = dense64(ad)
        leaves += [a, b]
        s, e = seg[i], seg[i + 1]
        xi = x64[s:e]
        if masks is not None and ad.dropout > 0:
            xi = xi * masks[i][s:e].double() / (1 - ad.dropout)
        rows.append((s, e, ad.scale * (xi @ A) @ B))
    delta = torch.zeros_like(y)
    for s, e, v in rows:
        delta = delta.index_add(0, torch.arange(s, e), v)
    y = y + delta
    grads = torch.autograd.grad(y, leaves, grad.double())
    return y, grads


def assert_close(actual, expected):
    expected = expected.to(actual.dtype)
    rel = 1e-10 if actual.dtype == torch.float64 else 2e-5
    tol = rel * max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, rtol=rel, atol=tol)


def adapter_params(adapters):
    return [t for ad in adapters for t in (ad.lora_A, ad.lora_B)]


RANKS = {"r8": [8, 8, 8, 8], "r16": [16, 16, 16, 16], "r64": [64, 64, 64, 64], "mixed": [64, 8, 16, 32]}
SEG = [0, 0, 1, 18, 27]  # ragged: lengths 0, 1, 17, 9; rows 27..29 belong to no adapter
T = 30


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("ranks", list(RANKS))
@pytest.mark.parametrize("layout", ["column", "row", "both"])
def test_grouped_forward_backward(layout, ranks, n):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layout}{ranks}{n}".encode()))
    layouts = ["column", "row"] * 2 if layout == "both" else [layout] * 4
    adapters = [make_adapter(gen, r, lay, n) for r, lay in zip(RANKS[ranks], layouts)]
    x = torch.randn(T, D_IN, generator=gen).requires_grad_()
    y, d = K.grouped_lora(x, SEG, adapters, options=P)
    assert d.backend == "triton"
    grad = torch.randn(T, D_OUT, generator=gen)
    grads = torch.autograd.grad(y, [x, *adapter_params(adapters)], grad)
    y64, grads64 = oracle(x, SEG, adapters, grad)
    assert_close(y, y64)
    for g, g64 in zip(grads, grads64):
        assert_close(g, g64)


def test_grouped_matches_torch_reference_and_peft():
    from peft.tuners.lora.variants import BlockDiagonalLinear

    gen = torch.Generator().manual_seed(1)
    ad = make_adapter(gen, 16, "row", 4)
    x = torch.randn(12, D_IN, generator=gen)
    with torch.no_grad():
        y = K.grouped_lora(x, [0, 12], [ad], options=P).out
        lin_a = BlockDiagonalLinear(D_IN, 16, 4)
        lin_a.weight.copy_(ad.lora_A)
        peft_y = ad.scale * (lin_a(x) @ ad.lora_B.t())
    assert_close(y, peft_y)
    assert_close(y, K.grouped_lora_ref(x, [0, 12], [ad]))


def test_grouped_inplace_out_and_layout_helpers():
    gen = torch.Generator().manual_seed(2)
    adapters = [make_adapter(gen, 16, "column", 2), make_adapter(gen, 8, "row", 2)]
    x = torch.randn(T, D_IN, generator=gen).requires_grad_()
    base = torch.randn(T, D_OUT, generator=gen).requires_grad_()
    out = base * 1.0
    seg = [3, 4, 20]
    y = K.grouped_lora(x, seg, adapters, out=out, options=P).out
    assert y is out
    grad = torch.randn(T, D_OUT, generator=gen)
    gx, gbase = torch.autograd.grad(y, [x, base], grad)
    y64, grads64 = oracle(x, seg, adapters, grad)
    assert_close(y, y64 + base.detach())
    assert_close(gx, grads64[0])
    assert_close(gbase, grad)
    # math <-> PEFT orientation round trip
    A, B = to_math(adapters[0])
    back = from_math(A, B, "column", 2)
    assert torch.equal(back.lora_A, adapters[0].lora_A) and torch.equal(back.lora_B, adapters[0].lora_B)


def assert_layer_matches_oracle(y, x, weight, bias, seg, adapters, masks, grad):
    """y and the gradients of x, weight, bias (if any) and every factor equal the float64 oracle's."""
    leaves = [x, weight] + ([bias] if bias is not None else []) + adapter_params(adapters)
    grads = torch.autograd.grad(y, leaves, grad)
    y64, grads64 = oracle(x, seg, adapters, grad, weight, bias, masks)
    assert_close(y, y64)
    for g, g64 in zip(grads, grads64):
        assert_close(g, g64)


@pytest.mark.parametrize("fuse_base", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_linear_with_dropout(fuse_base, with_bias):
    gen = torch.Generator().manual_seed(3 + 2 * fuse_base + with_bias)
    adapters = [make_adapter(gen, 16, "column", 4, dropout=0.1), make_adapter(gen, 64, "row", 2, dropout=0.3),
                make_adapter(gen, 8, "column", 1), make_adapter(gen, 32, "row", 4, dropout=0.5)]
    seg = [0, 1, 1, 17, T]
    x = torch.randn(T, D_IN, generator=gen).requires_grad_()
    weight = (torch.randn(D_OUT, D_IN, generator=gen) / 8).requires_grad_()
    bias = torch.randn(D_OUT, generator=gen).requires_grad_() if with_bias else None
    y, d = K.fused_lora_linear(x, weight, bias, seg, adapters, dropout_seed=77, options=opts(fuse_base=fuse_base))
    assert d.backend == "triton"
    masks = [K.dropout_keep_mask(77, (T, D_IN), ad.dropout) for ad in adapters]
    grad = torch.randn(T, D_OUT, generator=gen)
    assert_layer_matches_oracle(y, x, weight, bias, seg, adapters, masks, grad)


def test_plan_cache_is_shared_by_layers_of_one_batch_and_keeps_each_calls_seed(monkeypatch):
    """Two "layers" with the same rows, segments and adapter shapes but other factors share one plan; each call still
    gets its own factors, output and gradients (float64 oracle), a dropout call its own seed's masks; other
    segments build another plan."""
    gen = torch.Generator().manual_seed(11)
    seg = [0, 1, 1, 17, T]
    cache: dict = {}
    built = []
    # the module K's functions run in (test modules re-import bdlora.kernels, so sys.modules may hold a newer one)
    grouped = K.fused_lora_linear.__globals__
    real = grouped["_Plan"]
    monkeypatch.setitem(grouped, "_Plan", lambda *a, **k: built.append(1) or real(*a, **k))
    for seed in (5, 9):
        adapters = [make_adapter(gen, 16, "column", 4, dropout=0.1), make_adapter(gen, 64, "row", 2),
                    make_adapter(gen, 8, "column", 1), make_adapter(gen, 32, "row", 4, dropout=0.5)]
        for ad in adapters:  # same shapes, scales and rates in both layers: only the values differ
            object.__setattr__(ad, "scale", 1.25)
        x = torch.randn(T, D_IN, generator=gen).requires_grad_()
        weight = (torch.randn(D_OUT, D_IN, generator=gen) / 8).requires_grad_()
        y, d = K.fused_lora_linear(x, weight, None, seg, adapters, dropout_seed=seed, options=opts(),
                                   plan_cache=cache)
        assert d.backend == "triton" and len(built) == 1 and len(cache) == 1
        masks = [K.dropout_keep_mask(seed, (T, D_IN), ad.dropout) for ad in adapters]
        assert_layer_matches_oracle(y, x, weight, None, seg, adapters, masks, torch.randn(T, D_OUT, generator=gen))
    K.grouped_lora(x.detach(), [0, 2, 2, 17, T], adapters, options=opts(), plan_cache=cache)
    assert len(built) == 2 and len(cache) == 2


def test_dropout_mask_and_eval_mode():
    m1 = K.dropout_keep_mask(5, (64, 64), 0.25)
    assert torch.equal(m1, K.dropout_keep_mask(5, (64, 64), 0.25))
    assert not torch.equal(m1, K.dropout_keep_mask(6, (64, 64), 0.25))
    assert abs(m1.float().mean().item() - 0.75) < 0.05
    # without autograd recording, dropout is off (inference)
    gen = torch.Generator().manual_seed(4)
    ad = make_adapter(gen, 16, "column", 2, dropout=0.5)
    x = torch.randn(8, D_IN, generator=gen)
    with torch.no_grad():
        y = K.grouped_lora(x, [0, 8], [ad], options=P).out
    assert_close(y, oracle(x, [0, 8], [ad], torch.zeros(8, D_OUT))[0])


def _decode_case(gen, layout, n, ranks, d_outs, t, idx, d_in=D_IN):
    na, nb = (n, 1) if layout == "row" else (1, n)
    per_slice = [[None if r == 0 else (torch.randn(r, d_in // na, generator=gen), torch.randn(d, r // nb, generator=gen))
                  for r in ranks] for d in d_outs]
    a, b, rk, offs = K.stack_decode_weights(per_slice, max(ranks), layout, n)
    x = torch.randn(t, d_in, generator=gen)
    scales = torch.rand(len(ranks), generator=gen) + 0.5
    y0 = torch.randn(t, offs[-1], generator=gen)
    # float64 oracle from the per-slice dense factors
    want = y0.double().clone()
    for ti, ai in enumerate(idx):
        if ai < 0 or ranks[ai] == 0:
            continue
        for s, (lo, hi) in enumerate(zip(offs, offs[1:])):
            la, lb = per_slice[s][ai]
            A = torch.block_diag(*torch.chunk(la.double(), na, dim=0)).t()
            B = torch.block_diag(*torch.chunk(lb.double(), nb, dim=0)).t()
            want[ti, lo:hi] += float(scales[ai]) * (x[ti].double() @ A) @ B
    return y0, x, a, b, rk, scales, offs, want


@pytest.mark.parametrize("layout,n,slices", [("column", 1, 3), ("column", 2, 3), ("column", 4, 3),
                                             ("row", 1, 1), ("row", 2, 1), ("row", 4, 1)])
@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("d_in", [D_IN, 32])  # the CPU tiles split 64 input columns over 2 programs, 32 over 1
def test_decode(layout, n, slices, t, d_in):
    gen = torch.Generator().manual_seed(10 * n + t + (layout == "row") + d_in)
    ranks = [8, 16, 0, 64, 32]  # slot 2 empty
    d_outs = [64, 32, 32][:slices] if slices == 3 else [D_OUT]
    idx = torch.tensor([3, -1, 1, 0, 2, 4, 3, 0, -1][:t] if t > 1 else [4])
    y0, x, a, b, rk, scales, offs, want = _decode_case(gen, layout, n, ranks, d_outs, t, idx.tolist(), d_in)
    y = y0.clone()
    out, d = K.decode_lora(y, x, a, b, idx, rk, scales, offs, layout=layout, nblocks=n)
    assert out is y and d.backend == "triton"
    assert_close(y, want)
    ref = K.decode_lora_ref(y0.clone(), x, a, b, idx, rk, scales, offs, layout, n)
    assert_close(ref, want)


def test_decode_grid():
    """Shrink programs split the input dimension in block_k columns, expand programs tile the widest output block in
    block_n columns; the workspace holds one fp32 partial per (token, group, split, rank)."""
    from bdlora.kernels.decode import DecodeTiles, decode_grid

    gpu = DecodeTiles(block_k=128, block_n=64, block_s=16, warps=4)
    g = decode_grid(1, 2, 1, 3584, 4096, 38, gpu)  # batch 1, one GPU of TP=4: gate/up at BD rank 152/4
    assert (g.n_groups, g.k_splits, g.n_tiles, g.block_r) == (2, 32, 56, 64)
    assert g.partials == 2 * 32 * 64
    g = decode_grid(3, 1, 4, 4096 // 4, 1000, 64, gpu)  # column layout N=4: 4 groups, ragged last split
    assert (g.n_groups, g.k_splits, g.n_tiles, g.block_r) == (4, 8, 16, 16)


def test_decode_workspace_reuse():
    """One workspace serves call after call and layer after layer (different shapes) once reserved for the
    largest; a workspace reserved too small is refused with the fix, not overrun."""
    from bdlora.kernels.decode import decode_grid, decode_tiles

    gen = torch.Generator().manual_seed(5)
    ws = K.DecodeWorkspace("cpu")
    cases = [("column", 2, [64, 32, 32], 128, 3), ("row", 4, [D_OUT], 128, 1), ("column", 1, [48], 96, 5)]
    for layout, n, d_outs, d_in, t in cases:
        nb = 1 if layout == "row" else n
        grid = decode_grid(t, len(d_outs), nb, max(d_outs) // nb, d_in, 64, decode_tiles(torch.device("cpu")))
        assert grid.k_splits == d_in // 32
        ws.reserve(grid)
    for rep in range(2):
        for layout, n, d_outs, d_in, t in cases:
            idx = torch.tensor([4, 0, -1, 3, 1][:t])
            y0, x, a, b, rk, scales, offs, want = _decode_case(gen, layout, n, [8, 16, 0, 64, 32], d_outs, t,
                                                               idx.tolist(), d_in)
            ws.partials.fill_(float("nan"))  # stale partials of another call must never be read
            y = K.decode_lora(y0.clone(), x, a, b, idx, rk, scales, offs, layout=layout, nblocks=n, workspace=ws).out
            assert_close(y, want)
    small = K.DecodeWorkspace("cpu")
    y0, x, a, b, rk, scales, offs, _ = _decode_case(gen, "column", 1, [8], [32], 2, [0, 0], 128)
    with pytest.raises(ValueError, match="reserve it for the largest batch"):
        K.decode_lora(y0, x, a, b, torch.tensor([0, 0]), rk, scales, offs, workspace=small)


def test_decode_64_tokens():
    gen = torch.Generator().manual_seed(64)
    idx = (torch.arange(64) % 5) - 1  # -1, 0, 1, 2, 3, ...
    y0, x, a, b, rk, scales, offs, want = _decode_case(gen, "column", 2, [16, 16, 64, 8], [64, 32, 32], 64,
                                                       idx.tolist())
    y = K.decode_lora(y0.clone(), x, a, b, idx, rk, scales, offs, layout="column", nblocks=2).out
    assert_close(y, want)


def _folded_case(gen, ranks, d_outs, t, idx, d_in=D_IN):
    """Base weight with the A factors folded under it (per slice and slot, ragged ranks), B stacked, and a float64
    oracle of base + LoRA built from the separate factors."""
    w, per_slice, folded, b, rk, offs = folded_layer(gen, ranks, d_outs, d_in)
    x = torch.randn(t, d_in, generator=gen)
    scales = torch.rand(len(ranks), generator=gen) + 0.5
    return w, folded, x, b, rk, scales, offs, folded_oracle(x, w, per_slice, idx, ranks, scales, offs)


@pytest.mark.parametrize("d_outs", [[64, 32, 32], [D_OUT], [40, 72]])  # qkv-like, one slice, ragged tiles
@pytest.mark.parametrize("t", [1, 9])
def test_decode_folded(d_outs, t):
    """One GEMM with [W; A] then one launch: equals base + LoRA from the separate factors for tokens of every slot,
    of an empty slot (rank 0) and without LoRA (-1; their rows are the base output, written by the kernel too)."""
    gen = torch.Generator().manual_seed(len(d_outs) * 10 + t)
    ranks = [8, 16, 0, 32, 5]
    idx = torch.tensor([3, -1, 1, 0, 2, 4, 3, 0, -1][:t] if t > 1 else [4], dtype=torch.int32)
    w, folded, x, b, rk, scales, offs, want = _folded_case(gen, ranks, d_outs, t, idx.tolist())
    assert folded.base.data_ptr() == folded.w_ext.data_ptr() and torch.equal(folded.base, w)
    y, d = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs)
    assert d.backend == "triton" and y.shape == (t, sum(d_outs))
    assert_close(y, want)
    y_torch, d = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, options=K.KernelOptions(backend="torch"))
    assert d.backend == "torch"
    assert_close(y_torch, want)
    assert_close(K.decode_lora_folded_ref(x, folded.w_ext, folded.d_out, b, idx, rk, scales, offs), want)


def test_decode_folded_refuses_mismatched_fold():
    gen = torch.Generator().manual_seed(3)
    w, folded, x, b, rk, scales, offs, _ = _folded_case(gen, [8, 4], [32, 32], 2, [0, 1])
    wrong = K.fold_weight(w, 2, 3, 8)  # folded for 3 slots, B for 2
    with pytest.raises(ValueError, match=r"fold_weight\(W, S, L, R\)"):
        K.decode_lora_folded(x, wrong, b, torch.tensor([0, 1]), rk, scales, offs)


# ---- cuBLAS-composed fused linear (backend="cublas"; on CPU the same torch GEMMs on the CPU BLAS) ----------------

def cast_adapter(ad, dtype):
    a, b = (t.detach().to(dtype).requires_grad_() for t in (ad.lora_A, ad.lora_B))
    return LoraFactors(a, b, ad.layout, ad.nblocks, ad.scale, ad.dropout)


CUBLAS_CASES = {  # name: (seg, T); "multi": lengths 0, 1, 17, 9 and rows 27..29 in no segment
    "multi": (SEG, T), "one_token": ([0, 1], 1), "odd": ([0, 7], 7), "partial": ([2, 7], 8)}


def _cublas_case(dtype, layout, ranks, n, case, dropout=0.0, bias=False, train_w=False):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{layout}{ranks}{n}{case}{dropout}{bias}".encode()))
    seg, t = CUBLAS_CASES[case]
    na = len(seg) - 1
    layouts = ["column", "row"] * 2 if layout == "both" else [layout] * 4
    adapters = [cast_adapter(make_adapter(gen, r, lay, n, dropout=dropout), dtype)
                for r, lay in zip(RANKS[ranks][:na], layouts[:na])]
    x = torch.randn(t, D_IN, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(D_OUT, D_IN, generator=gen) / 8).to(dtype).requires_grad_(train_w)
    b = torch.randn(D_OUT, generator=gen).to(dtype).requires_grad_(train_w) if bias else None
    return gen, seg, t, adapters, x, weight, b


@pytest.mark.parametrize("case", list(CUBLAS_CASES))
@pytest.mark.parametrize("n,bd_gemm", [(1, "dense"), (2, "dense"), (2, "blocks"), (4, "dense"), (4, "blocks")])
@pytest.mark.parametrize("ranks", ["r8", "r16", "r64"])
@pytest.mark.parametrize("layout", ["column", "row", "both"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cublas_fused_linear(dtype, layout, ranks, n, bd_gemm, case):
    """y, dX, dA, dB of the cuBLAS path vs the float64 oracle; W frozen (the layer benchmark's setting)."""
    gen, seg, t, adapters, x, weight, _ = _cublas_case(dtype, layout, ranks, n, case)
    y, d = K.fused_lora_linear(x, weight, None, seg, adapters, options=opts(backend="cublas", bd_gemm=bd_gemm))
    assert d.backend == "cublas" and y.dtype == dtype
    grad = torch.randn(t, D_OUT, generator=gen).to(dtype)
    grads = torch.autograd.grad(y, [x, *adapter_params(adapters)], grad)
    y64, grads64 = oracle(x, seg, adapters, grad, weight)
    assert_close(y, y64)
    for g, g64 in zip(grads, [grads64[0], *grads64[2:]]):  # oracle grads: x, weight, a_0, b_0, ...
        assert_close(g, g64)


@pytest.mark.parametrize("bd_gemm", ["dense", "blocks"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cublas_fused_linear_dropout_bias_weight_grad(dtype, bias, bd_gemm):
    """Dropout (masks of reference.segment_keep_mask), bias and a trainable weight, mixed layouts and ranks."""
    gen, seg, t, adapters, x, weight, b = _cublas_case(dtype, "both", "mixed", 4, "multi", dropout=0.3, bias=bias,
                                                       train_w=True)
    adapters[2].dropout = 0.0  # one adapter without dropout beside ones with it
    y = K.fused_lora_linear(x, weight, b, seg, adapters, dropout_seed=77, options=opts(backend="cublas", bd_gemm=bd_gemm)).out
    masks = K.torch_keep_masks(x, seg, adapters, 77)
    assert masks[2] is None and all(m[:seg[i]].sum() == 0 for i, m in enumerate(masks) if m is not None)
    grad = torch.randn(t, D_OUT, generator=gen).to(dtype)
    assert_layer_matches_oracle(y, x, weight, b, seg, adapters, masks, grad)
    # the torch backend draws the same masks from the same seed
    y_ref = K.fused_lora_linear(x, weight, b, seg, adapters, dropout_seed=77, options=opts(backend="torch")).out
    assert_close(y, y_ref)
    # without autograd recording dropout is off
    with torch.no_grad():
        y_eval = K.fused_lora_linear(x, weight, b, seg, adapters, dropout_seed=77,
                                     options=opts(backend="cublas", bd_gemm=bd_gemm)).out
    assert_close(y_eval, oracle(x, seg, adapters, grad, weight, b)[0])


@pytest.mark.parametrize("bd_gemm", ["dense", "blocks"])
@pytest.mark.parametrize("compute,master", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32)])
def test_cublas_fused_linear_wider_factors(compute, master, bd_gemm):
    """Factors stored wider than x and the weight (fp32 master weights beside a bf16 base): the products run in the
    compute dtype, as under torch.autocast, i.e. equal to the oracle on the factors rounded to that dtype; the
    factors' gradients come back in their own dtype. Dropout and an empty segment included."""
    gen, seg, t, adapters, x, weight, _ = _cublas_case(compute, "both", "mixed", 4, "multi", dropout=0.3)
    adapters[3].dropout = 0.0
    wide = [cast_adapter(make_adapter(gen, ad.rank, ad.layout, 4, dropout=ad.dropout), master) for ad in adapters]
    y, d = K.fused_lora_linear(x, weight, None, seg, wide, dropout_seed=5, options=opts(backend="cublas", bd_gemm=bd_gemm))
    assert d.backend == "cublas" and y.dtype == compute
    grad = torch.randn(t, D_OUT, generator=gen).to(compute)
    grads = torch.autograd.grad(y, [x, *adapter_params(wide)], grad)
    assert [g.dtype for g in grads] == [compute] + [master] * (2 * len(wide))
    rounded = [cast_adapter(ad, compute) for ad in wide]  # what autocast feeds the GEMMs
    y64, grads64 = oracle(x, seg, rounded, grad, weight, masks=K.torch_keep_masks(x, seg, rounded, 5))
    if compute == torch.float32:
        assert_close(y, y64)
        for g, g64 in zip(grads, [grads64[0], *grads64[2:]]):
            assert_close(g.to(compute), g64)  # computed in fp32: fp32's tolerance
    else:  # bf16 products: within bf16 rounding of the oracle (rel. to each tensor's scale)
        for g, g64 in zip([y, *grads], [y64, grads64[0], *grads64[2:]]):
            scale = max(1.0, float(g64.abs().max()))
            assert float((g.double() - g64).abs().max()) <= 0.03 * scale
    live = [g for i in range(len(wide)) if seg[i + 1] > seg[i] for g in grads[1 + 2 * i:3 + 2 * i]]
    assert live and all(float(g.abs().max()) > 0 for g in live)  # gradients reach the non-empty segments' factors


@pytest.mark.parametrize("fuse_base", [False, True])
def test_triton_fused_linear_wider_factors(fuse_base):
    """fp32 master factors beside a bf16 base on the grouped Triton kernels: the products run in bf16 with fp32
    accumulation, as on the cuBLAS path and under torch.autocast (within bf16 rounding of the float64 oracle on the
    factors rounded to bf16); the factors' gradients come back in fp32. Dropout and an empty segment included."""
    gen, seg, t, adapters, x, weight, _ = _cublas_case(torch.bfloat16, "both", "mixed", 4, "multi", dropout=0.3)
    adapters[3].dropout = 0.0
    if fuse_base:  # the base GEMM runs in the LoRA tiles: the segments cover every row
        seg = seg[:-1] + [t]
    wide = [cast_adapter(make_adapter(gen, ad.rank, ad.layout, 4, dropout=ad.dropout), torch.float32)
            for ad in adapters]
    y, d = K.fused_lora_linear(x, weight, None, seg, wide, dropout_seed=5, options=opts(fuse_base=fuse_base))
    assert d.backend == "triton" and "products in x's dtype" in d.note and y.dtype == torch.bfloat16
    grad = torch.randn(t, D_OUT, generator=gen).to(torch.bfloat16)
    grads = torch.autograd.grad(y, [x, *adapter_params(wide)], grad)
    assert [g.dtype for g in grads] == [torch.bfloat16] + [torch.float32] * (2 * len(wide))
    rounded = [cast_adapter(ad, torch.bfloat16) for ad in wide]
    masks = [K.dropout_keep_mask(5, (t, D_IN), ad.dropout) for ad in rounded]
    y64, grads64 = oracle(x, seg, rounded, grad, weight, masks=masks)
    for g, g64 in zip([y, *grads], [y64, grads64[0], *grads64[2:]]):
        scale = max(1.0, float(g64.abs().max()))
        assert float((g.double() - g64).abs().max()) <= 0.03 * scale
    live = [g for i in range(len(wide)) if seg[i + 1] > seg[i] for g in grads[1 + 2 * i:3 + 2 * i]]
    assert live and all(float(g.abs().max()) > 0 for g in live)


@pytest.mark.parametrize("first", ["bdlora.kernels.cublas", "vllm_plugin.fast_path.ops"])
def test_training_op_and_serving_ops_share_the_namespace(first):
    """The training layer's custom op and the vLLM plugin's ops live in one ``bdlora`` op namespace, which is
    process-wide: importing both, in either order, registers every op once (a clash of names fails the import)."""
    pytest.importorskip("vllm")
    other = {"bdlora.kernels.cublas", "vllm_plugin.fast_path.ops"} - {first}
    code = (f"import {first}, {other.pop()}, torch; "
            "print(all(hasattr(torch.ops.bdlora, n) for n in ('train_lora_linear', 'train_lora_linear_backward', "
            "'lora_linear', 'fold_linear')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("True"), done.stderr[-2000:]


@pytest.mark.parametrize("layout,n", [("column", 4), ("row", 4), (None, 1), ("column", 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_cublas_custom_op_equals_the_autograd_function(layout, n, bias):
    """``bdlora::train_lora_linear`` (the cuBLAS layer inside compiled graphs) gives the output and the x / factor
    gradients of ``CublasLoraLinearFn`` bit for bit (same products, same routes), against the float64 oracle as well,
    with a bf16 activation and fp32 factors, only the gradients asked for; it passes torch's custom-op checks (schema,
    fake impl, autograd registration, AOT dispatch with dynamic shapes)."""
    gen = torch.Generator().manual_seed(31)
    t = 37  # ragged
    ad = make_adapter(gen, 16, layout, n)
    x = torch.randn(t, D_IN, generator=gen).requires_grad_()
    w = torch.randn(D_OUT, D_IN, generator=gen) / D_IN ** 0.5
    b = torch.randn(D_OUT, generator=gen) if bias else None
    gy = torch.randn(t, D_OUT, generator=gen)
    leaves = [x, ad.lora_A, ad.lora_B]
    y_fn = cublas_mod.cublas_lora_linear(x, w, b, [0, t], [ad], None, K.KernelOptions())[0]
    g_fn = torch.autograd.grad(y_fn, leaves, gy)
    y_op = cublas_mod.compiled_lora_linear(x, w, b, ad)
    g_op = torch.autograd.grad(y_op, leaves, gy)
    assert torch.equal(y_op, y_fn) and all(torch.equal(p, q) for p, q in zip(g_op, g_fn))
    y64, grads64 = oracle(x, [0, t], [ad], gy, w, b)
    torch.testing.assert_close(y_op.double(), y64, rtol=1e-4, atol=1e-4)
    for g, g64 in zip(g_op, [grads64[0], *grads64[-2:]]):
        torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-4)
    # only dB wanted (x and A frozen): the other gradients are not computed
    g_b = torch.autograd.grad(cublas_mod.compiled_lora_linear(x.detach(), w, b, dataclasses.replace(
        ad, lora_A=ad.lora_A.detach())), [ad.lora_B], gy)[0]
    assert torch.equal(g_b, g_fn[2])
    # bf16 activations and base, fp32 factors (bdlora train's bf16 precision): the Function's numerics
    xh, wh = x.detach().bfloat16().requires_grad_(), w.bfloat16()
    bh = None if b is None else b.bfloat16()
    y_fn = cublas_mod.cublas_lora_linear(xh, wh, bh, [0, t], [ad], None, K.KernelOptions())[0]
    y_op = cublas_mod.compiled_lora_linear(xh, wh, bh, ad)
    assert y_op.dtype == torch.bfloat16 and torch.equal(y_op, y_fn)
    g_fn = torch.autograd.grad(y_fn, [xh, ad.lora_A, ad.lora_B], gy.bfloat16())
    g_op = torch.autograd.grad(y_op, [xh, ad.lora_A, ad.lora_B], gy.bfloat16())
    assert [g.dtype for g in g_op] == [torch.bfloat16, torch.float32, torch.float32]
    assert all(torch.equal(p, q) for p, q in zip(g_op, g_fn))
    torch.library.opcheck(torch.ops.bdlora.train_lora_linear.default,
                          (x, w, b, ad.lora_A, ad.lora_B, layout or cublas_mod.DENSE_LAYOUT, n, ad.scale))
    with pytest.raises(ValueError, match="dropout"):
        cublas_mod.compiled_lora_linear(x, w, b, dataclasses.replace(ad, dropout=0.1))


def unlogged(fn, calls, name):
    """fn run outside every TorchDispatchMode, its name appended to calls."""
    from torch.utils._python_dispatch import _disable_current_modes

    def run(*args, **kwargs):
        calls.append(name)
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return run


def test_cublas_no_activation_copies(monkeypatch):
    """The only ops that produce or write activation-sized tensors are GEMMs (plus the dropout mask ops and the
    NaN poisoning of fresh buffers): no copy, cat, add or scale kernels on activations, in either bd_gemm mode;
    and every GEMM operand (block views included) has a layout cuBLAS takes without a copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    t, d = 256, 64
    big = t * d // 2

    def cublas_takes_as_is(m):
        """ATen's CUDA Blas.cpp (prepare_(batch_)matrix_for_cublas, baddbmm result) copies a GEMM operand unless
        its last two dims are row- or column-major with a leading dimension >= the row length (any batch stride)."""
        (r, c), (sr, sc) = m.shape[-2:], m.stride()[-2:]
        return m.is_contiguous() or (sc == 1 and sr >= max(1, c)) or (sr == 1 and sc >= max(1, r))

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.layouts_ok = [], True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if not func.is_view and any(isinstance(a, torch.Tensor) and a.numel() >= big
                                        for a in [*args, *(kwargs or {}).values(), *outs]):
                self.ops.append(func.overloadpacket.__name__)
            if func.overloadpacket.__name__ in ("addmm_", "baddbmm_"):
                self.layouts_ok &= all(cublas_takes_as_is(a) for a in args[:3])
            return out

    gen = torch.Generator().manual_seed(9)
    with Log() as mask_log:  # what drawing one mask costs in torch ops (the counter hash, dropout.py)
        K.segment_keep_mask(1, 0, t, d, 0.2, "cpu")
    for layout, bd_gemm, p, fused in [("column", "dense", 0.0, None), ("row", "dense", 0.0, None),
                                      ("column", "blocks", 0.0, None), ("row", "blocks", 0.0, None),
                                      ("row", "dense", 0.2, False), ("row", "dense", 0.2, True)]:
        launches = []
        for name in ("drop_shrink", "drop_expand_t", "drop_wgrad_a"):  # the interpreter's own tensor copies unlogged
            monkeypatch.setattr(cublas_mod, name, unlogged(getattr(dropout_mod, name), launches, name))
        ad = make_adapter(gen, 16, layout, 4, d_in=d, d_out=d, dropout=p)
        x = torch.randn(t, d, generator=gen).requires_grad_()
        w = torch.randn(d, d, generator=gen)
        gy = torch.randn(t, d, generator=gen)
        with Log() as log:
            y = K.fused_lora_linear(x, w, None, [0, t], [ad], dropout_seed=1,
                                    options=opts(backend="cublas", bd_gemm=bd_gemm, fused_dropout=fused)).out
            torch.autograd.grad(y, [x, ad.lora_A, ad.lora_B], gy)
        heavy = [op for op in log.ops if op not in ("empty", "new_empty", "fill_", "zero_", "new_zeros", "zeros")]
        gemms = [op for op in heavy if op in ("addmm_", "baddbmm_")]
        others = [op for op in heavy if op not in gemms]
        assert log.layouts_ok, (layout, bd_gemm)
        if fused:  # shrink, LoRA dX and dA are Triton kernels that draw the mask themselves: no other op
            assert len(gemms) == 5 and others == [], log.ops
            assert launches == ["drop_shrink", "drop_wgrad_a", "drop_expand_t"], launches
            continue
        # fwd: shrink, expand, base; bwd: dS, dB (reads dY), dA, LoRA dX, base dX
        assert len(gemms) == 8, (layout, bd_gemm, p, log.ops)
        if p:  # draw keep, invert it once, zero dropped inputs, zero dropped input grads (no dtype promotion)
            assert sorted(others) == sorted(mask_log.ops + ["logical_not_", "masked_fill", "masked_fill_"]), heavy
        else:
            assert others == [], heavy


def test_cublas_dispatch_rules():
    """Documented choice: on CUDA "auto" takes cublas for one non-empty segment or a layer of >= CUBLAS_MIN_WEIGHT
    weights (no fuse_base); on CPU "auto" keeps Triton under the interpreter (torch without it); "cublas" runs
    anywhere when asked for."""
    pref = dispatch_mod.cublas_preferred
    assert pref("cuda", 1, 576, 576) and pref("cuda", 16, 4096, 4096) and pref("cuda", 4, 4096, 1024)
    assert not pref("cuda", 2, 576, 1536) and not pref("cuda", 8, 576, 576)
    assert not pref("cpu", 1, 4096, 4096)
    def ch(backend, triton_ok, cublas=dispatch_mod.NOT_AN_OPTION, prefer_cublas=False, **kw):
        cub = cublas if cublas == dispatch_mod.NOT_AN_OPTION else (None if cublas else "cannot")
        return dispatch_mod.resolve("op", K.KernelOptions(backend=backend, **kw), "cuda",
                                    triton=None if triton_ok else "cannot", cublas=cub, prefer_cublas=prefer_cublas)[0]

    assert ch("auto", True, cublas=True, prefer_cublas=True) == "cublas"
    assert ch("auto", False, cublas=True, prefer_cublas=True) == "cublas"
    assert ch("auto", True, cublas=False, prefer_cublas=True) == "triton"
    assert ch("auto", True, cublas=True, prefer_cublas=False) == "triton"
    assert ch("auto", False, cublas=True, prefer_cublas=False) == "torch"
    assert ch("cublas", False, cublas=True) == "cublas"
    with pytest.raises(RuntimeError):
        ch("cublas", True, cublas=False)
    with pytest.raises(ValueError):
        ch("cublas", True)  # an op without a cuBLAS path

    gen = torch.Generator().manual_seed(5)
    ad = make_adapter(gen, 16, "column", 2)
    x = torch.randn(6, D_IN, generator=gen)
    w = torch.randn(D_OUT, D_IN, generator=gen)
    assert K.fused_lora_linear(x, w, None, [0, 6], [ad]).backend == "triton"  # CPU + interpreter
    assert K.fused_lora_linear(x, w, None, [0, 6], [ad], options=opts(backend="cublas")).backend == "cublas"
    with pytest.raises(ValueError):
        K.fused_lora_linear(x, w, None, [0, 6], [ad], options=opts(fuse_base=True, backend="cublas"))
    with pytest.raises(ValueError):
        K.fused_lora_linear(x, w, None, [0, 6], [ad], options=opts(backend="cublas", bd_gemm="sparse"))
    with pytest.raises(ValueError):
        K.grouped_lora(x, [0, 6], [ad], options=opts(backend="cublas"))
    with pytest.raises(RuntimeError, match="x/weight/bias dtypes differ"):  # x and the weight in different dtypes
        K.fused_lora_linear(x.double(), w, None, [0, 6], [ad], options=opts(backend="cublas"))


def test_dispatch_returns_the_backend_it_ran_and_no_module_switches_remain():
    """Every entry point returns LoraResult(out, Dispatch) naming the backend that ran; a requested backend that
    cannot run raises, or with fallback=True gives way and says so; options are frozen; no kernel module keeps
    mutable switches or a record of the last backend."""
    import importlib
    import pkgutil

    gen = torch.Generator().manual_seed(3)
    ad = make_adapter(gen, 8, "column", 2)
    x = torch.randn(6, D_IN, generator=gen)
    w = torch.randn(D_OUT, D_IN, generator=gen)
    for backend in ("triton", "torch", "cublas"):
        res = K.fused_lora_linear(x, w, None, [0, 6], [ad], options=K.KernelOptions(backend=backend))
        assert isinstance(res, K.LoraResult) and res.backend == res.dispatch.backend == backend
        assert res.dispatch.op == "fused_lora_linear" and res.dispatch.requested == backend
    assert K.grouped_lora(x, [0, 6], [ad], options=K.KernelOptions(backend="torch")).backend == "torch"
    auto = K.fused_lora_linear(x, w, None, [0, 6], [ad])
    assert auto.backend == "triton" and auto.dispatch.note.startswith("auto")
    assert K.fused_lora_linear(x, w, None, [0, 6], [ad], options=K.KernelOptions(interpreter=False)).backend == "torch"
    with pytest.raises(RuntimeError, match="x/weight/bias dtypes differ"):
        K.fused_lora_linear(x.double(), w, None, [0, 6], [ad], options=K.KernelOptions(backend="cublas"))
    fb = K.fused_lora_linear(x.double(), w.double(), None, [0, 6], [ad],
                             options=K.KernelOptions(backend="triton", fallback=True))
    assert fb.backend != "triton" and fb.dispatch.note.startswith("fell back from triton")
    gap = K.fused_lora_linear(x, w, None, [0, 2, 4, 6], [ad, None, ad],
                              options=K.KernelOptions(backend="cublas", fallback=True))
    assert gap.backend == "torch" and "without adapter" in gap.dispatch.note
    torch.testing.assert_close(gap.out[2:4], x[2:4] @ w.t())
    with pytest.raises(dataclasses.FrozenInstanceError):
        K.KernelOptions().backend = "torch"
    old = {"LAST_BACKEND", "POISON_OUTPUTS", "FUSED_DROPOUT", "FUSED_DSDB", "choose"}
    mods = [importlib.import_module(f"bdlora.kernels.{m.name}") for m in pkgutil.iter_modules(K.__path__)]
    assert {m.__name__.rsplit(".", 1)[1] for m in mods} >= {"grouped", "cublas", "dropout", "decode", "dispatch"}
    assert "_triton" not in {m.__name__.rsplit(".", 1)[1] for m in mods}  # kernels live beside their launchers
    for mod in [K] + mods:
        assert not old & set(vars(mod)), (mod.__name__, old & set(vars(mod)))
        mutable = [n for n, v in vars(mod).items() if n.isupper() and isinstance(v, (dict, list, set))]
        assert not mutable, (mod.__name__, mutable)


FALLBACK_SCRIPT = r"""
import os, torch
os.environ.pop("TRITON_INTERPRET", None)
import bdlora.kernels as K
from bdlora.layout import LoraFactors
ad = LoraFactors(torch.randn(16, 32), torch.randn(48, 4), "column", 4, 0.5)
x = torch.randn(10, 32, requires_grad=True)
y, d = K.grouped_lora(x, [0, 3, 10], [ad, ad])
assert d.backend == "torch", d
assert torch.allclose(y, K.grouped_lora_ref(x, [0, 3, 10], [ad, ad]))
y.sum().backward()
w = torch.randn(48, 32)
assert K.fused_lora_linear(x, w, None, [0, 10], [ad]).backend == "torch"
yc, d = K.fused_lora_linear(x, w, None, [0, 10], [ad], options=K.KernelOptions(backend="cublas"))
assert d.backend == "cublas"
assert torch.allclose(yc, K.fused_lora_linear_ref(x, w, None, [0, 10], [ad]), atol=1e-5)
a, b, rk, offs = K.stack_decode_weights([[(ad.lora_A, ad.lora_B)]], 16, "column", 4)
d = K.decode_lora(torch.zeros(2, 48), x[:2].detach(), a, b, torch.tensor([0, -1]), rk, torch.ones(1), offs, nblocks=4)
assert d.backend == "torch"
try:
    K.grouped_lora(x, [0, 10], [ad], options=K.KernelOptions(backend="triton"))
    raise SystemExit("backend='triton' should refuse CPU tensors without the interpreter")
except RuntimeError:
    pass
print("ok")
"""


def test_dispatcher_falls_back_on_cpu_without_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
