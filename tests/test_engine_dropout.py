"""LoRA dropout in the multi-LoRA engine (PEFT semantics): per-job p on the job's LoRA input while training, none at
evaluation; p=0 unchanged; reproducible from the seeds; the saved folder records lora_dropout; equal to PEFT trained
alone with the same masks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bdlora.spec import BDLoraSpec
from test_engine_utils import peft_train_alone, run_dict, write_alpaca

torch.set_num_threads(1)

D_IN, D_OUT, T = 32, 48, 40
NAME = "layers.0.proj"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_alpaca(tmp_path_factory.mktemp("data") / "rev.jsonl", n=30)


def _module(layout, ps):
    from bdlora.train.engine.multilora import BatchContext, JobAdapter, MultiLoraLinear

    torch.manual_seed(0)
    ctx, registry = BatchContext(), {}
    mod = MultiLoraLinear(nn.Linear(D_IN, D_OUT), NAME, layout, ctx, registry)
    for j, p in enumerate(ps):
        ja = JobAdapter(BDLoraSpec(nblocks=2, r=8, lora_alpha=16.0, lora_dropout=p), {NAME: (layout, D_IN, D_OUT)},
                        seed=j)
        with torch.no_grad():
            ja.b["m0"].normal_()
        registry[j] = ja
    return mod, ctx, registry


def _fwd(mod, ctx, x, segs, seed=None):
    ctx.use_segments(segs)
    try:
        if seed is not None:
            torch.manual_seed(seed)
        return mod(x)
    finally:
        ctx.use_segments([])


@pytest.mark.parametrize("backend", ["torch", "engine"])
@pytest.mark.parametrize("layout", ["column", "row"])
@pytest.mark.parametrize("segs", [[(0, 0, T)], [(0, 0, 10), (1, 10, 25), (2, 25, 32)]])
def test_torch_path_drops_each_jobs_rows_with_its_own_p(backend, layout, segs):
    from bdlora.kernels import lora_delta_ref

    ps = [0.5, 0.0, 0.25][:len(segs)]
    mod, ctx, reg = _module(layout, ps)
    ctx.backend = backend
    x = torch.randn(T, D_IN, requires_grad=True)
    y = _fwd(mod, ctx, x, segs, seed=123)
    # reference: PEFT's order, F.dropout on each dropping job's rows in segment order from the same RNG state
    torch.manual_seed(123)
    ref = mod.base(x)
    for j, s, e in segs:
        ja = reg[j]
        xj = F.dropout(x[s:e], ja.dropout, training=True) if ja.dropout > 0 else x[s:e]
        a, b = ja.factors(NAME)
        ad = ja.kernel_adapter(NAME, dropout=False)  # the factors (xj already dropped out)
        ref = ref + F.pad(lora_delta_ref(xj, ad), (0, 0, s, T - e))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # the dropout really acted, and only on jobs with p > 0; the base path is untouched
    with torch.no_grad():
        clean = _fwd(mod, ctx, x, segs)
    for j, s, e in segs:
        same = torch.allclose(y[s:e].detach(), clean[s:e])
        assert same == (ps[j] == 0)
    end = segs[-1][2]
    assert torch.equal(y[end:].detach(), clean[end:])  # rows in no segment: the base output
    # evaluation (no_grad, or ctx.training off): deterministic, no dropout
    with torch.no_grad():
        assert torch.equal(_fwd(mod, ctx, x, segs, seed=1), _fwd(mod, ctx, x, segs, seed=2))
    ctx.training = False
    torch.testing.assert_close(_fwd(mod, ctx, x, segs, seed=1).detach(), clean, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["column", "row"])
def test_kernel_path_gets_the_jobs_dropout_and_a_seed_from_torch_rng(layout, monkeypatch):
    import dataclasses

    import bdlora.train.engine.multilora as ml

    calls = []
    real = ml.fused_lora_linear

    def spy(x, weight, bias, seg, adapters, *, dropout_seed=None, options, plan_cache=None):
        # runs the kernels' torch reference
        res = real(x, weight, bias, seg, adapters, dropout_seed=dropout_seed, plan_cache=plan_cache,
                   options=dataclasses.replace(options, backend="torch", torch_dropout="counter"))
        calls.append(([ad.dropout for ad in adapters], res.dispatch.dropout_seed))
        return res

    monkeypatch.setattr(ml, "fused_lora_linear", spy)
    segs = [(0, 0, 10), (1, 10, 25), (2, 25, 32)]
    mod, ctx, reg = _module(layout, [0.5, 0.0, 0.25])
    ctx.backend = "triton"
    x = torch.randn(T, D_IN, requires_grad=True)
    y1, y2 = _fwd(mod, ctx, x, segs, seed=7), _fwd(mod, ctx, x, segs, seed=7)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)  # the seed comes from torch's RNG
    assert calls[0][0] == [0.5, 0.0, 0.25] and calls[0][1] is not None and calls[0][1] == calls[1][1]
    assert not torch.equal(_fwd(mod, ctx, x, segs, seed=8), y1)
    with torch.no_grad():
        clean = _fwd(mod, ctx, x, segs)
    assert calls[-1] == ([0.0, 0.0, 0.0], None)  # evaluation: no dropout in the descriptors, no seed
    assert torch.equal(y1[10:25].detach(), clean[10:25]) and not torch.equal(y1[:10].detach(), clean[:10])


@pytest.mark.parametrize("layout", ["column", "row"])
def test_cublas_path_drops_each_jobs_rows_with_its_own_mask(layout):
    """lora_backend "cublas" (the GPU default; CPU BLAS here): base + every job's LoRA in one fused op whose masks
    are ``segment_keep_mask(seed + i)`` with the seed from torch's RNG: outputs and all gradients equal the torch
    reference with those masks; p=0 jobs and rows in no segment are untouched; evaluation drops nothing."""
    from bdlora.kernels import grouped_lora_ref, torch_keep_masks

    segs, seg = [(0, 0, 10), (1, 10, 25), (2, 25, 32)], [0, 10, 25, 32]
    mod, ctx, reg = _module(layout, [0.5, 0.0, 0.25])
    ctx.backend = "cublas"
    x = torch.randn(T, D_IN, requires_grad=True)
    y = _fwd(mod, ctx, x, segs, seed=5)
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    ads = [reg[j].kernel_adapter(NAME, True) for j, _, _ in segs]
    ref = mod.base(x) + grouped_lora_ref(x, seg, ads, torch_keep_masks(x, seg, ads, seed))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn_like(y)
    params = [x] + [t for ad in ads for t in (ad.lora_A, ad.lora_B)]
    for got, want in zip(torch.autograd.grad(y, params, gy), torch.autograd.grad(ref, params, gy)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)  # fp32, other summation order
    with torch.no_grad():
        clean = _fwd(mod, ctx, x, segs)
    assert not torch.allclose(y[:10].detach(), clean[:10]) and not torch.allclose(y[25:32].detach(), clean[25:32])
    torch.testing.assert_close(y[10:25].detach(), clean[10:25], rtol=1e-6, atol=1e-6)
    assert torch.equal(clean[32:], mod.base(x)[32:].detach())


def test_kernel_path_with_triton_interpreter():
    from bdlora.kernels import dispatch

    if not (dispatch.HAS_TRITON and dispatch.INTERPRET):
        pytest.skip("needs triton with TRITON_INTERPRET=1 on CPU")
    segs = [(0, 0, 16), (1, 16, 32)]
    mod, ctx, _ = _module("column", [0.5, 0.0])
    ctx.backend = "triton"
    x = torch.randn(32, D_IN, requires_grad=True)
    y1, y2 = _fwd(mod, ctx, x, segs, seed=3), _fwd(mod, ctx, x, segs, seed=3)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    y1.sum().backward()
    with torch.no_grad():
        clean = _fwd(mod, ctx, x, segs)
    assert not torch.allclose(y1[:16].detach(), clean[:16])
    torch.testing.assert_close(y1[16:].detach(), clean[16:], rtol=2e-4, atol=2e-4)


def _engine(tiny_llama_dir, data_file, out, jobs, **kw):
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.engine import Engine

    return Engine(parse_run(run_dict(tiny_llama_dir, data_file, out, jobs, **kw)))


def test_engine_trains_with_dropout(tiny_llama_dir, data_file, tmp_path):
    from bdlora import load_adapter

    def jobs(p):
        return [{"name": "a", "r": 4, "nblocks": 2, "seed": 1, "lora_dropout": p},
                {"name": "b", "r": 8, "nblocks": 4, "seed": 2}]

    runs = {}
    for tag, p in (("p0", 0.0), ("drop", 0.3), ("drop-again", 0.3)):
        eng = _engine(tiny_llama_dir, data_file, tmp_path / tag, jobs(p))
        rows = eng.run()
        assert all(r["stop_reason"] == "completed" for r in rows)
        assert all(torch.isfinite(torch.tensor(l)) for j in eng.jobs for _, l in j.history["train"])
        runs[tag] = (eng, rows)
    (e0, r0), (e1, r1), (e2, r2) = runs["p0"], runs["drop"], runs["drop-again"]
    a0, a1, a2 = (load_adapter(r[0]["adapter"]) for r in (r0, r1, r2))
    # dropout changed job a's training; the same seeds reproduce it exactly
    assert any(not torch.allclose(a0.modules[k].lora_B, a1.modules[k].lora_B) for k in a0.modules)
    for k in a1.modules:
        assert torch.equal(a1.modules[k].lora_A, a2.modules[k].lora_A)
        assert torch.equal(a1.modules[k].lora_B, a2.modules[k].lora_B)
    # job b (p=0) is unaffected by its neighbour's dropout
    b0, b1 = load_adapter(r0[1]["adapter"]), load_adapter(r1[1]["adapter"])
    for k in b0.modules:
        torch.testing.assert_close(b0.modules[k].lora_B, b1.modules[k].lora_B, rtol=1e-4, atol=2e-5)
    # the PEFT folder records each job's lora_dropout
    for row, p in zip(r1, (0.3, 0.0)):
        with open(f"{row['adapter']}/adapter_config.json") as f:
            assert json.load(f)["lora_dropout"] == p


def test_evaluation_has_no_dropout(tiny_llama_dir, data_file, tmp_path):
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "e", [{"name": "a", "r": 4, "lora_dropout": 0.5}])
    eng.admit()
    eng.train_round()
    job = eng.jobs[0]
    torch.manual_seed(0)
    v1 = eng.evaluate([job])
    torch.manual_seed(1)
    v2 = eng.evaluate([job])
    assert v1 == v2 and torch.isfinite(torch.tensor(v1[job.id]))
    # equal to the same factors without dropout
    job.adapter.dropout = 0.0
    assert eng.evaluate([job]) == v1


def test_dropout_equals_peft_with_the_same_masks(tiny_llama_dir, data_file, tmp_path):
    """One job, one sample per step (one micro-batch, no padding): PEFT's nn.Dropout and the engine draw the same
    masks from torch's RNG seeded with the engine's per-micro-batch seed."""
    from peft import get_peft_model_state_dict

    from bdlora import load_adapter, save_adapter
    from bdlora.train.engine.data import EpochSampler
    from bdlora.train.engine.multilora import JobAdapter, round_seed

    job_d = {"name": "d", "r": 8, "nblocks": 2, "seed": 5, "lora_dropout": 0.3, "batch_size": 1, "max_steps": 4,
             "lr": 3e-3}
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", [job_d], lora_backend="torch")
    rows = eng.run()
    job = eng.jobs[0]
    cfg = job.cfg
    spec = cfg.spec("llama")
    targets = {n: t for n, t in eng.targets.items() if n.rsplit(".", 1)[-1] in spec.target_modules}
    init_dir = tmp_path / "init"
    save_adapter(JobAdapter(spec, targets, seed=cfg.seed).to_adapter(str(tiny_llama_dir)), init_dir)
    sampler = EpochSampler(len(job.data.train), cfg.step_samples, seed=cfg.seed)
    model, losses = peft_train_alone(tiny_llama_dir, init_dir, cfg, job.data.train, job.total_steps, sampler,
                                     step_seed=lambda k: round_seed("lora-dropout", 0, [(cfg.seed, k)], 0))
    assert [l for _, l in job.history["train"]] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    ref = get_peft_model_state_dict(model)
    saved = load_adapter(rows[0]["adapter"])
    for p, f in saved.modules.items():
        torch.testing.assert_close(f.lora_A, ref[p + ".lora_A.weight"], rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(f.lora_B, ref[p + ".lora_B.weight"], rtol=1e-4, atol=2e-5)
    # and differs from PEFT without dropout (the masks mattered)
    sampler = EpochSampler(len(job.data.train), cfg.step_samples, seed=cfg.seed)
    _, losses0 = peft_train_alone(tiny_llama_dir, init_dir, cfg, job.data.train, job.total_steps, sampler)
    assert losses0[1:] != pytest.approx(losses[1:], rel=1e-5)


def test_resume_with_dropout_equals_uninterrupted(tiny_llama_dir, data_file, tmp_path):
    from bdlora import load_adapter

    jobs = [{"name": "a", "r": 4, "nblocks": 2, "lora_dropout": 0.2, "max_steps": 4}]
    full = _engine(tiny_llama_dir, data_file, tmp_path / "full", jobs).run()
    kw = dict(resume="auto", save_every=1)
    _engine(tiny_llama_dir, data_file, tmp_path / "part", jobs, max_rounds=2, **kw).run()
    rows = _engine(tiny_llama_dir, data_file, tmp_path / "part", jobs, **kw).run()
    a, b = load_adapter(rows[0]["adapter"]), load_adapter(full[0]["adapter"])
    for p in a.modules:
        torch.testing.assert_close(a.modules[p].lora_B, b.modules[p].lora_B, rtol=0, atol=1e-7)
