"""MultiLoraLinear on its own: every backend equals the kernels' torch reference (outputs and gradients), for one
job over all rows, several jobs with gaps, and a job without the module; descriptors are reused, not rebuilt."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from bdlora.kernels import grouped_lora_ref
from bdlora.spec import BDLoraSpec

torch.set_num_threads(1)

D_IN, D_OUT = 32, 48


def _setup(n_jobs: int, layout: str):
    from bdlora.train.engine.multilora import BatchContext, JobAdapter, MultiLoraLinear

    torch.manual_seed(0)
    base = nn.Linear(D_IN, D_OUT)
    ctx, registry = BatchContext(), {}
    mod = MultiLoraLinear(base, "layers.0.proj", layout, ctx, registry)
    for j in range(n_jobs):
        spec = BDLoraSpec(nblocks=2 if j % 2 == 0 else 4, r=8, lora_alpha=16.0)
        ja = JobAdapter(spec, {"layers.0.proj": (layout, D_IN, D_OUT)}, seed=j)
        with torch.no_grad():
            ja.b["m0"].normal_()  # B starts at zero: make the delta visible
        registry[j] = ja
    return mod, ctx, registry


@pytest.mark.parametrize("backend", ["auto", "torch", "engine", "triton"])
@pytest.mark.parametrize("layout", ["column", "row"])
@pytest.mark.parametrize("case", ["one-job-all-rows", "jobs-with-gaps", "job-without-module"])
def test_multilora_linear_matches_reference(backend, layout, case):
    from bdlora.kernels import dispatch

    if backend == "triton" and not (dispatch.HAS_TRITON and dispatch.INTERPRET):
        pytest.skip("needs triton with TRITON_INTERPRET=1 on CPU")
    n_jobs = {"one-job-all-rows": 1, "jobs-with-gaps": 3, "job-without-module": 2}[case]
    mod, ctx, registry = _setup(n_jobs, layout)
    ctx.backend = backend
    T = 40
    segs = {"one-job-all-rows": [(0, 0, T)],
            "jobs-with-gaps": [(0, 0, 10), (1, 10, 25), (2, 25, 32)],  # rows 32.. are in no segment
            "job-without-module": [(0, 0, 16), (1, 16, T)]}[case]
    if case == "job-without-module":
        registry[1].keys = {}  # job 1 does not train this module: its rows get the base output only
    x = torch.randn(2, T // 2, D_IN, requires_grad=True)
    ctx.use_segments(segs)
    y = mod(x)
    ctx.use_segments([])
    g = torch.randn_like(y)
    y.backward(g)

    live = [(j, s, e) for j, s, e in segs if mod.name in registry[j].keys]
    x_ref = x.detach().clone().requires_grad_(True)
    ads = [registry[j].kernel_adapter(mod.name) for j, _, _ in live]
    a_grads = [(ad.lora_A.grad.clone(), ad.lora_B.grad.clone()) for ad in ads]
    for ad in ads:
        ad.lora_A.grad = ad.lora_B.grad = None
    seg = [live[0][1]] + [e for _, _, e in live]
    x2 = x_ref.reshape(T, D_IN)
    y_ref = mod.base(x2) + grouped_lora_ref(x2, seg, ads)
    y_ref.backward(g.reshape(T, D_OUT))
    # the torch paths run the reference's ops; the Triton kernels (interpreted) sum in another order
    tol = dict(rtol=2e-4, atol=2e-4) if backend == "triton" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.reshape(T, D_OUT), y_ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    for ad, (ga, gb) in zip(ads, a_grads):
        torch.testing.assert_close(ga, ad.lora_A.grad, **tol)
        torch.testing.assert_close(gb, ad.lora_B.grad, **tol)


def test_kernel_adapter_is_reused_until_the_parameters_change():
    mod, ctx, registry = _setup(1, "column")
    ja = registry[0]
    first = ja.kernel_adapter(mod.name)
    assert ja.kernel_adapter(mod.name) is first
    with torch.no_grad():
        ja.a["m0"].add_(1.0)  # in-place updates (optimizer steps) keep the descriptor
    assert ja.kernel_adapter(mod.name) is first
    ja.a["m0"] = nn.Parameter(ja.a["m0"].detach().clone())  # a new parameter object: rebuilt
    second = ja.kernel_adapter(mod.name)
    assert second is not first and second.lora_A is ja.a["m0"]


@pytest.mark.parametrize("layout", ["column", "row"])
def test_bf16_base_with_fp32_factors_takes_one_cublas_op(layout):
    """The usual GPU setting: a bf16 base and fp32 job factors. lora_backend "cublas" runs base + every job's LoRA
    as one op with bf16 products (autocast numerics: the oracle on bf16-rounded factors), fp32 factor gradients."""
    mod, ctx, registry = _setup(3, layout)
    mod.base.to(torch.bfloat16)
    ctx.backend, T = "cublas", 40
    segs = [(0, 0, 10), (1, 10, 25), (2, 25, 32)]  # rows 32.. in no segment
    x = torch.randn(T, D_IN).to(torch.bfloat16).requires_grad_(True)
    ctx.use_segments(segs)
    y = mod(x)
    ctx.use_segments([])
    assert mod.last_dispatch.backend == "cublas" and y.dtype == torch.bfloat16
    g = torch.randn(T, D_OUT).to(torch.bfloat16)
    y.backward(g)
    ads = [registry[j].kernel_adapter(mod.name) for j, _, _ in segs]
    assert all(t.grad.dtype == torch.float32 and t.grad.abs().max() > 0 for ad in ads for t in (ad.lora_A, ad.lora_B))
    # oracle in fp64 on what the GEMMs read: bf16 x, weight, bias and bf16-rounded factors
    rounded = [type(ad)(*(t.detach().to(torch.bfloat16).double().requires_grad_() for t in (ad.lora_A, ad.lora_B)),
                        ad.layout, ad.nblocks, ad.scale) for ad in ads]
    x64 = x.detach().double().requires_grad_()
    y64 = (x64 @ mod.base.weight.double().t() + mod.base.bias.double()
           + grouped_lora_ref(x64, [0, 10, 25, 32], rounded))
    y64.backward(g.double())
    for got, want in [(y, y64), (x.grad, x64.grad)] + [(getattr(ad, f).grad, getattr(r, f).grad)
                                                       for ad, r in zip(ads, rounded) for f in ("lora_A", "lora_B")]:
        err = float((got.double() - want).abs().max())
        assert err <= 0.02 * max(1.0, float(want.abs().max())), err
