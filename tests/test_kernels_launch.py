"""bdlora.kernels.launch: the kept-kernel (direct) launches of the serving kernels.

The direct launch itself needs a GPU (``bench/kernels/bench_serving_kernels.py``'s check calls every folded and
two-launch kernel twice, the second time directly, and requires bit-identical outputs; BENCHMARKS.md, "Prefill host
time"). Here: the key that decides when a kept kernel may be reused, the argument order handed to it, the hook
guard, and that the CPU interpreter always goes through Triton.
"""
import pytest
import torch

from bdlora.kernels import decode as D
from bdlora.kernels import launch as L


def test_key_separates_what_triton_specializes_on():
    base = torch.zeros(64)
    key = L.specialization_key
    # tensors: dtype and 16-byte alignment (a view 1 float in is 4 bytes off)
    assert key((base,), {}) == key((torch.ones(64),), {})
    assert key((base,), {}) != key((base[1:],), {})
    assert key((base,), {}) != key((base.half(),), {})
    # ints: the value 1, multiples of 16, 32 vs 64 bit; other values of one class share a key
    assert key((20,), {}) == key((36,), {})
    assert len({key((v,), {}) for v in (1, 16, 17, 1 << 31)}) == 4
    # bools, strings and None by value, not as ints; keywords by value
    assert key((True,), {}) != key((1,), {}) and key(("ieee",), {}) != key(("tf32",), {})
    assert key((None,), {}) != key((0,), {})
    assert key((base,), {"BLOCK_M": 16}) != key((base,), {"BLOCK_M": 32})


def test_tail_is_the_keyword_parameters_in_signature_order():
    kern = D._fold_expand_gemm_kernel
    kw = dict(USE_GDC=False, PREC="tf32", ONE_SLOT=True, BLOCK_R=64, BLOCK_N=64, BLOCK_M=16, num_warps=4)
    # BLOCK_M, BLOCK_N, BLOCK_R, ONE_SLOT, PREC, USE_GDC, then BLOCK_J's default (0) where it is not passed
    assert L._tail(kern, 16, kw) == (16, 64, 64, True, "tf32", False, 0)
    assert L._tail(kern, 16, {**kw, "BLOCK_J": 256})[-1] == 256
    assert L._tail(kern, 16, {k: v for k, v in kw.items() if k != "PREC"}) is None  # missing: Triton reports it
    # a constexpr passed positionally (BLOCK_M as the 17th argument) is keyed by its int class only: never kept
    assert L._tail(kern, 17, {k: v for k, v in kw.items() if k != "BLOCK_M"}) is None


def test_hook_guard_follows_tritons_hooks():
    knobs = pytest.importorskip("triton").knobs
    assert not L._hooks()
    hook = lambda *a, **k: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert L._hooks()  # a profiler's hook: its launches must go through Triton, which calls it
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not L._hooks()


def test_interpreter_goes_through_triton_and_matches_the_reference():
    from bdlora.kernels import decode_lora_folded, decode_lora_folded_ref, fold_weight
    from bdlora.kernels.decode import ExpandTiles

    if not L.dispatch.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=g)
    f = fold_weight(w, 2, 2, 16)
    f.lora_a(2, 2, 16).copy_(torch.randn(2, 2, 16, 32, generator=g))
    b = torch.randn(2, 48, 16, generator=g)
    idx = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int32)
    ranks, scales = torch.tensor([16, 7], dtype=torch.int32), torch.tensor([0.5, 2.0])
    x = torch.randn(5, 32, generator=g)
    direct = L.LAUNCHES.direct
    for _ in range(2):
        y = decode_lora_folded(x, f, b, idx, ranks, scales, [0, 40, 48], kernel="gemm", tiles=ExpandTiles()).out
        ref = decode_lora_folded_ref(x.double(), f.w_ext.double(), 48, b.double(), idx, ranks, scales.double(),
                                     [0, 40, 48])
        torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)
    assert L.LAUNCHES.direct == direct  # nothing kept or relaunched off a GPU


def test_kept_launch_keeps_a_kernel_only_where_the_varying_ints_are_not_specialized():
    jit = pytest.importorskip("triton.runtime.jit")
    fn = D._fold_expand_gemm_kernel.fn  # the Python function behind the kernel (also under the interpreter)
    unspecialized = jit.JITFunction(fn, do_not_specialize=["T"])
    specialized = jit.JITFunction(fn)
    assert L.KeptLaunch(unspecialized, fresh=(0, 1), varying=(6,)).keepable  # T: one compiled kernel for all T
    assert not L.KeptLaunch(specialized, fresh=(0, 1), varying=(6,)).keepable  # T=1 and T%16 compile apart
    assert not L.KeptLaunch(unspecialized, varying=(7,)).keepable  # stride_y is specialized
    assert L.KeptLaunch(specialized, fresh=(0, 1)).keepable  # nothing varies but fresh tensors


def _folded_layer(g, n_slots=2, rank=16, offs=(0, 40, 48), d_in=32):
    from bdlora.kernels import fold_weight

    d_out = offs[-1]
    f = fold_weight(torch.randn(d_out, d_in, generator=g), len(offs) - 1, n_slots, rank)
    f.lora_a(len(offs) - 1, n_slots, rank).copy_(torch.randn(len(offs) - 1, n_slots, rank, d_in, generator=g))
    return f, torch.randn(n_slots, d_out, rank, generator=g), list(offs)


@pytest.mark.parametrize("kernel", ["decode", "gemm"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_folded_launch_reads_its_bound_buffers_at_every_call(kernel, backend):
    """A plan (what the plugin keeps per layer) binds the live slot ids, ranks and scales: changing them in place
    between calls (a new batch's mapping, a new adapter's rank) changes its next result, as decode_lora_folded
    with the new values gives."""
    from bdlora.kernels import KernelOptions, decode_lora_folded, decode_lora_folded_ref
    from bdlora.kernels.decode import ExpandTiles, FoldedLaunch

    g = torch.Generator().manual_seed(5)
    f, b, offs = _folded_layer(g)
    slots = torch.full((9,), -1, dtype=torch.int32)  # the serving buffer: longer than most batches
    ranks, scales = torch.tensor([16, 7], dtype=torch.int32), torch.tensor([0.5, 2.0])
    opts = KernelOptions(backend=backend)
    plan = FoldedLaunch(f, b, slots, ranks, scales, offs, kernel=kernel, tiles=ExpandTiles(16, 32, 1), options=opts)
    if backend == "auto" and L.dispatch.INTERPRET:
        assert plan.dispatch.backend == "triton"
    for t, ids, rk in ((5, [1, -1, 0, 1, 0], [16, 7]), (3, [0, 0, 1], [4, 16]), (9, [1] * 9, [16, 16])):
        slots[:t] = torch.tensor(ids, dtype=torch.int32)
        ranks.copy_(torch.tensor(rk, dtype=torch.int32))
        x = torch.randn(t, 32, generator=g)
        y = plan(x)
        ref = decode_lora_folded_ref(x.double(), f.w_ext.double(), 48, b.double(), slots[:t], ranks,
                                     scales.double(), offs)
        torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)
        once = decode_lora_folded(x, f, b, slots[:t], ranks, scales, offs, kernel=kernel,
                                  tiles=ExpandTiles(16, 32, 1), options=opts).out
        assert torch.equal(y, once)  # the one-off entry point runs the same plan
    assert plan(torch.randn(0, 32)).shape == (0, 48)
    with pytest.raises(ValueError, match="10 tokens but 9 slot ids"):
        plan(torch.randn(10, 32))


def test_folded_launch_refuses_what_it_cannot_prepare():
    from bdlora.kernels.decode import FoldedLaunch

    g = torch.Generator().manual_seed(6)
    f, b, offs = _folded_layer(g)
    args = (torch.zeros(4, dtype=torch.int32), torch.tensor([16, 7], dtype=torch.int32), torch.ones(2))
    with pytest.raises(ValueError, match="goes through decode_lora_folded"):
        FoldedLaunch(f, b, *args, offs, kernel="gemv")
    with pytest.raises(ValueError, match="kernel must be one of"):
        FoldedLaunch(f, b, *args, offs, kernel="bgmv")
    with pytest.raises(ValueError, match="expected d_out=48 rows of W"):
        FoldedLaunch(f, b[:, :40], *args, [0, 40], kernel="gemm")
